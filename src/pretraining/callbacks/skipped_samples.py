"""The count of unusable training samples, on the logs, and the limit on it."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from pretraining.data.contract import training_data
from pretraining.objectives.step_values import logs_written_at


class SkippedSamples(Callback):
    """Every `trainer.log_every_n_steps` optimizer steps and at the last, sum over all ranks the
    samples the training stream read and skipped (`ShardDataModule.samples_read`, `samples_skipped`),
    log `data/skipped_samples` and `data/samples_read`, and stop the run if too many were skipped
    (`ShardDataModule.check_skips`). One small all-reduce, at the same steps on every rank, so that
    all stop together. `train.py` adds it to every run: it enforces the data config's policy.
    """

    def __init__(self) -> None:
        self.checked_step = -1

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self.checked_step or not logs_written_at(trainer, step):
            return  # mid-accumulation, checked already, or not a logging step
        self.checked_step = step
        data = training_data(trainer, "data.bad_data")
        counts = torch.tensor([data.samples_read, data.samples_skipped], device=pl_module.device)
        read, skipped = trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        pl_module.log_dict({"data/samples_read": read, "data/skipped_samples": skipped})
        data.check_skips(skipped, read)
