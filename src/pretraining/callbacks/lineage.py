"""Stamp every checkpoint with what produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

# 2: data configs name BlockDataModule/PairDataModule and `val_size` (was ShardDataModule and `val_blocks`).
LINEAGE_FORMAT = 2


def code_revision(directory: Path) -> dict[str, Any]:
    """The git commit of `directory` and whether the tree has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


class Lineage(Callback):
    """Adds `checkpoint["lineage"]`: the resolved config, code revision, data
    version, tokenizer fingerprint and the checkpoint the run resumed from, so
    every checkpoint can be traced back and rebuilt by `evaluate.py`."""

    def __init__(self, config: dict, data_version: str, tokenizer_fingerprint: str, code: dict[str, Any]) -> None:
        self.record = {
            "format": LINEAGE_FORMAT,
            "config": config,
            "code": code,
            "data_version": data_version,
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "resumed_from": config.get("ckpt_path"),
        }

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["lineage"] = self.record
