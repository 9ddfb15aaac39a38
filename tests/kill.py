"""A callback for resume tests: the whole process group dies by SIGKILL after a given training batch,
as if the machine had failed (no handler, no cleanup)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class KillAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.batches_consumed == self.batch:  # type: ignore[attr-defined]
            os.killpg(os.getpgid(0), signal.SIGKILL)
