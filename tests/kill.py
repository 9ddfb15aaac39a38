"""Callbacks for resume tests: a machine failure (`KillAt`) or a signal from a scheduler (`SignalAt`)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class KillAt(Callback):
    """The whole process group dies by SIGKILL after a given training batch (no handler, no cleanup)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.batches_consumed == self.batch:  # type: ignore[attr-defined]
            os.killpg(os.getpgid(0), signal.SIGKILL)


class SignalAt(Callback):
    """Send `signum` to this process (only) after a given training batch: a scheduler's notice."""

    def __init__(self, batch: int, signum: int) -> None:
        self.batch, self.signum = batch, signum

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.batches_consumed == self.batch:  # type: ignore[attr-defined]
            os.kill(os.getpid(), self.signum)
