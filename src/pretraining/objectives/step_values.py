"""Logging an objective's `step_values` from its own callback (`configure_callbacks`), so no hook of an
objective must call `super()` for it."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer


class WithStepValues(Protocol):
    step_values: dict[str, torch.Tensor | float]  # this step's training values, as computed


class LogStepValues(Callback):
    """Logs `step_values` at the steps Lightning writes, the last, and one where training stops, once the
    step's callbacks added theirs. Every step would cost bookkeeping for rows never written; values logged
    elsewhere would stand in later rows. Under accumulation, the last micro-batch's values."""

    def __init__(self) -> None:
        self.unlogged: dict[str, torch.Tensor | float] | None = None  # the step under way's, if not logged

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        module = cast(WithStepValues, pl_module)
        values, module.step_values = module.step_values, {}
        if logs_written_at(trainer, trainer.global_step + 1):  # the step under way
            log_values(pl_module, values)
        else:
            self.unlogged = values

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.unlogged is not None and trainer.should_stop:
            log_values(pl_module, self.unlogged)
        self.unlogged = None


def log_values(module: LightningModule, values: dict[str, torch.Tensor | float]) -> None:
    """Log a step's training values, the loss on the progress bar too."""
    loss = values.pop("train/loss", None)
    module.log_dict(values)
    if loss is not None:
        module.log("train/loss", loss, prog_bar=True)


def logs_written_at(trainer: Trainer, step: int) -> bool:
    """Whether step `step`'s (from 1) values are logged: Lightning writes it, or it is the last."""
    return step % trainer.log_every_n_steps == 0 or step == trainer.max_steps  # type: ignore[attr-defined]
