"""Stamp every checkpoint with what produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from pretraining.checkpoint import LINEAGE_FORMAT
from pretraining.data.contract import training_data


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
    version, tokenizer fingerprint, the checkpoint this run continued from
    (`parent`), the W&B run id, the step, and the data's topology and sources
    (a mixture's weights and phases too), so every
    checkpoint can be traced back, rebuilt by `evaluate.py`, and checked
    against a run that would resume it. Another callback, or the objective, may
    add what it knows to the same record in its `on_save_checkpoint` (the
    weights a run started from, a distillation's teacher)."""

    def __init__(
        self, config: dict, data_version: str, tokenizer_fingerprint: str, code: dict[str, Any], parent: str | None
    ) -> None:
        self.parent = Path(parent) if parent else None
        self.record = {
            "format": LINEAGE_FORMAT,
            "config": config,
            "code": code,
            "data_version": data_version,
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "parent": parent,
        }

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        wandb_ids = [logger.version for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        checkpoint.setdefault("lineage", {}).update(
            self.record,
            **training_data(trainer, "lineage").lineage,
            step=trainer.global_step,
            wandb_run_id=wandb_ids[0] if wandb_ids else None,
        )


def trainer_lineage(trainer: Trainer) -> Lineage | None:
    """The `Lineage` of a training run (`pretrain`), None elsewhere (`pretrain-eval` trains nothing). Its
    `parent` is the checkpoint the run continues from, known from the set-up on: Lightning names it
    (`trainer.ckpt_path`) only once it restores it, after every `setup` hook."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, Lineage)), None)  # type: ignore[attr-defined]
