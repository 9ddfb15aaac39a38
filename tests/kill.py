"""Callbacks that interrupt or slow a run, for the resume and goodput tests: a machine failure (`KillAt`),
a signal from a scheduler (`SignalAt`), a callback that ends training (`StopAt`), an error (`RaiseAt`) and a
slow device (`SleepEachStep`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

import pretraining.checkpoint.store
from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.data.datamodule import ShardDataModule


class KillAt(Callback):
    """The whole process group (or, with `group=False`, the main process alone) dies by SIGKILL after a
    given training batch (no handler, no cleanup), once the checkpoint being written in the background is
    complete: a restart then goes back to the newest save before the kill, whatever the machine's load
    (tests/test_async_checkpoint.py kills during a write)."""

    def __init__(self, batch: int, group: bool = True) -> None:
        self.batch, self.group = batch, group

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.position.batches_consumed == self.batch:  # type: ignore[attr-defined]
            for checkpoint in trainer.checkpoint_callbacks:
                if isinstance(checkpoint, StepCheckpoint):
                    checkpoint.wait_until_written(trainer)  # every rank reaches this batch
            if self.group:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class KillBeforeTheFirstSidecar(Callback):
    """The whole process group dies by SIGKILL after the first checkpoint is renamed into place, before its
    sidecar is written (the last instant of a save at which a kill leaves something behind)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pretraining.checkpoint.store.write_sidecar = lambda *args: os.killpg(os.getpgid(0), signal.SIGKILL)


class SignalAt(Callback):
    """Send `signum` to this process (only) after a given training batch: a scheduler's notice."""

    def __init__(self, batch: int, signum: int) -> None:
        self.batch, self.signum = batch, signum

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.position.batches_consumed == self.batch:  # type: ignore[attr-defined]
            os.kill(os.getpid(), self.signum)


class StopAt(Callback):
    """Set `trainer.should_stop` after a given training micro-batch, as Lightning's Timer (`trainer.max_time`)
    does: inside a gradient accumulation when the batch is not a step's last."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.position.batches_consumed == self.batch:  # type: ignore[attr-defined]
            trainer.should_stop = True


class RaiseAt(Callback):
    """Raise a RuntimeError after a given training batch: a crash."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.position.batches_consumed == self.batch:  # type: ignore[attr-defined]
            raise RuntimeError(f"a crash after batch {self.batch}")


class SleepEachStep(Callback):
    """Sleep `seconds` after each training batch from step `after` on: a slow device or a straggler."""

    def __init__(self, seconds: float, after: int = 0) -> None:
        self.seconds, self.after = seconds, after

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step >= self.after:
            time.sleep(self.seconds)


class SignalInEveryPhase(Callback):
    """Send SIGTERM to this process once in each phase of a run (across its restarts: a file in
    `markers` records each phase signalled, with the time): the set-up before the validation before
    training, that validation, training, a checkpoint save, a validation inside training, the final
    validation and the final report (after the last stage's teardown). Only the `phases` listed, if
    given, and only on rank `rank`, if given."""

    def __init__(self, markers: str, max_steps: int, phases: list[str] | None = None, rank: int | None = None) -> None:
        self.markers, self.max_steps, self.phases, self.rank = Path(markers), max_steps, phases, rank
        self.markers.mkdir(parents=True, exist_ok=True)

    def signal_once(self, trainer: Trainer, phase: str) -> None:
        marker = self.markers / phase
        chosen = self.phases is None or phase in self.phases
        if chosen and trainer.global_rank == (self.rank or 0) and not marker.exists():
            marker.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)

    def final(self, trainer: Trainer) -> bool:
        return trainer.state.fn == TrainerFn.VALIDATING and trainer.global_step == self.max_steps

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.signal_once(trainer, "setup")

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # The validation a restart owes (the step it continues from) runs before `fit`, at that step.
        if pl_module.trained_steps == 0:
            self.signal_once(trainer, "validation_before_training")
        elif self.final(trainer):
            self.signal_once(trainer, "final_validation")
        else:
            self.signal_once(trainer, "validation_in_training")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == 6:  # after the first save, and its validation
            self.signal_once(trainer, "training")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.signal_once(trainer, "save")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.final(trainer):
            self.signal_once(trainer, "report")


class SignalingDataModule(ShardDataModule):
    """Sends SIGTERM to this process as the trainer asks for the training loader: after Lightning would
    have installed its signal handlers, before training starts."""

    def train_dataloader(self) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return super().train_dataloader()
