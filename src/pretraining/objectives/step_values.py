"""The logging of an objective's training values (`PretrainingObjective.step_values`): the objective's own
callback (its `configure_callbacks`), so that no hook of an objective has to call `super()` for it. Any
LightningModule with a `step_values` dict may return it."""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer


class WithStepValues(Protocol):
    step_values: dict[str, torch.Tensor | float]  # this step's training values, as computed


class LogStepValues(Callback):
    """Logs an objective's `step_values` with `self.log` at the steps Lightning writes (every
    `trainer.log_every_n_steps`-th) and the last, once the step's callbacks have added theirs, so that every
    callback sees them at the step's end; and at a step where a callback stops training (a signal, a time
    limit), so that its row holds its own values. Logged at every step, each value would cost Lightning's
    per-value bookkeeping for rows never written; logged at some steps only, it would stand in the rows of
    the others. Under gradient accumulation a step's values are its last micro-batch's."""

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
    """Whether the training values of optimizer step `step` (counted from 1) are logged: those of every
    `trainer.log_every_n_steps`-th step, whose logs Lightning writes, and of the last, which the run reports."""
    return step % trainer.log_every_n_steps == 0 or step == trainer.max_steps  # type: ignore[attr-defined]
