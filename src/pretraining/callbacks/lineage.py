"""Stamp every checkpoint with what produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger

from pretraining.checkpoint import LINEAGE_FORMAT
from pretraining.data.contract import training_data
from pretraining.models.backbone import Backbone


def code_revision(directory: Path) -> dict[str, Any]:
    """The git commit of `directory` and whether the tree has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


class Lineage(Callback):
    """Adds `checkpoint["lineage"]` (config, code revision, data version and sources, tokenizer fingerprint,
    `parent` checkpoint, W&B run id, step, the backbone's parametrization), so every checkpoint can be traced,
    rebuilt by `evaluate.py` and checked against a resume. Others may add to it in their `on_save_checkpoint` (a
    distillation's teacher, the `origin` of a run's first weights); `origin`, the resumed run's, is carried on by
    every later checkpoint."""

    def __init__(
        self,
        config: dict,
        data_version: str,
        tokenizer_fingerprint: str,
        code: dict[str, Any],
        parent: str | None,
        origin: dict[str, Any] | None = None,
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
        if origin:  # the callback that started the run writes the same again, if it is still configured
            self.record["origin"] = origin

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        wandb_ids = [logger.version for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        checkpoint.setdefault("lineage", {}).update(
            self.record,
            **training_data(trainer, "lineage").lineage,
            step=trainer.global_step,
            wandb_run_id=wandb_ids[0] if wandb_ids else None,
            # What a resume checks before it loads anything (`pretraining.resume.check_fits`).
            parametrization=cast(Backbone, pl_module.backbone).parametrization.record(),
        )


def trainer_lineage(trainer: Trainer) -> Lineage | None:
    """The `Lineage` of a training run, or None; its `parent` is known before Lightning's `trainer.ckpt_path`
    is (only after every `setup` hook)."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, Lineage)), None)  # type: ignore[attr-defined]
