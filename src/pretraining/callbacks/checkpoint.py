"""Checkpoints at step boundaries, through the trainer's writer (`AtomicCheckpointIO`) or, for FSDP2's
sharded checkpoints, written by every rank and published by rank zero (`pretraining.checkpoint`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from pretraining.checkpoint import (
    CheckpointError,
    link_last,
    newest_saved,
    prune,
    publish_sharded,
    sidecar_path,
    storage_fault,
)
from pretraining.files import temporary_path


class StepCheckpoint(Checkpoint):
    """Save every `every_n_steps` optimizer steps and at the last step, always at a step boundary
    (after the optimizer step, so gradient accumulation is respected), through the trainer's
    checkpoint writer (`AtomicCheckpointIO`), or as a sharded directory when the strategy saves
    shards (`save_sharded`). Keep the newest `keep_last` and, permanently, every step divisible by
    `keep_every`. Older ones are pruned only after the new one is complete. At least 2 are kept, so
    that a newest one damaged later (a disk fault, a bad copy) still leaves a fallback."""

    def __init__(
        self, dirpath: str, every_n_steps: int = 200, keep_last: int = 2, keep_every: int | None = None
    ) -> None:
        if every_n_steps < 1 or keep_last < 2 or (keep_every is not None and keep_every < 1):
            raise ValueError(
                f"callbacks.checkpoint: every_n_steps={every_n_steps} must be >= 1, keep_last={keep_last} >= 2 and "
                f"keep_every={keep_every} null or >= 1"
            )
        self.dirpath, self.every_n_steps = Path(dirpath), every_n_steps
        self.keep_last, self.keep_every = keep_last, keep_every
        self.saved_step = -1
        self.last_model_path = ""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.saved_step = trainer.global_step  # a resumed run does not save again the step it resumed from

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a smoke test: nothing worth keeping
            return
        if step % self.every_n_steps == 0 or step >= trainer.max_steps:
            self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        """Save the current step (once), point `last.ckpt` at it and prune."""
        step = trainer.global_step
        if step == self.saved_step:
            return
        path = self.dirpath / f"step-{step:06d}.ckpt"
        try:
            if saves_sharded(trainer):
                save_sharded(trainer, path)
            else:
                trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank zero writes
        except Exception as error:
            storage = storage_fault(error)
            if storage is None:
                raise
            raise CheckpointError(
                f"saving {path} failed: {storage}. Nothing was lost: {newest_saved(self.dirpath)}. Free space on "
                f"that disk or make {self.dirpath} writable (or point paths.log_dir elsewhere and pass "
                f"ckpt_path=<that checkpoint>), then run the same command to continue"
            ) from error
        self.saved_step, self.last_model_path = step, str(path)
        if trainer.is_global_zero:
            if not sidecar_path(path).is_file():  # the writer verified the bytes it wrote before its sidecar
                raise CheckpointError(
                    f"{path} was saved without a sidecar: the checkpoint was not written by AtomicCheckpointIO "
                    f"(trainer.plugins), or the strategy bypasses it (for sharded checkpoints use FSDP2: "
                    f"trainer=fsdp_cpu trainer.strategy.save_distributed_checkpoint=true)"
                )
            link_last(path)
            prune(self.dirpath, self.keep_last, self.keep_every, keep=path)
            for logger in trainer.loggers:  # as ModelCheckpoint does: a logger may keep it (W&B artifacts)
                logger.after_save_checkpoint(self)  # type: ignore[arg-type]  # loggers read last_model_path only


def saves_sharded(trainer: Trainer) -> bool:
    """Whether the strategy writes each checkpoint as a directory of shards from every rank, bypassing
    the trainer's checkpoint writer (FSDP2 with `save_distributed_checkpoint=true`)."""
    strategy = trainer.strategy
    return isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint


def save_sharded(trainer: Trainer, path: Path) -> None:
    """Every rank writes its shards into a fresh temporary directory beside `path`; the save ends with a
    barrier, after which rank zero publishes the complete directory under `path`."""
    temporary = Path(trainer.strategy.broadcast(str(temporary_path(path))))  # rank zero's name, on every rank
    try:
        trainer.save_checkpoint(temporary, weights_only=False)
        if trainer.is_global_zero:
            publish_sharded(temporary, path)
    finally:
        if trainer.is_global_zero and temporary.exists():  # a save that failed (published, it is gone)
            shutil.rmtree(temporary, ignore_errors=True)
