"""Stop cleanly when asked to: SIGTERM (`scancel`, a preemption, any scheduler), SIGUSR1 (SLURM's notice before the
time limit) or Ctrl-C."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.internals import end_training_loaders, install_signal_handlers_instead
from pretraining.slurm import NOTICE, EarlyNotice, job_to_requeue, requeue_this_job

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))


class Preempted(Exception):
    """Ends a validation that a signal interrupted: Lightning has no other way out of one."""


class Preemption(Callback):
    """On a signal, only set a flag (the state is always a completed step's); at the next step boundary the
    ranks agree on it, save, stop, and `train` exits with 128 + the signal, for a scheduler to requeue on. A
    validation checks the flag after every batch and raises `Preempted`, after saving its step if needed; the
    continued run validates that step again. With `requeue` under SLURM, rank zero requeues the job after the
    time-limit notice, USR1 (`pretraining.slurm`): a SIGTERM is `scancel` or a preemption, which SLURM requeues
    itself where it is configured to. A second Ctrl-C stops at once, unsaved.

    The handlers replace Lightning's, from each stage's `setup` to its teardown (`pretraining.internals`):
    its SIGTERM path runs a collective inside the handler, which can hang DDP, and can exit 0 unsaved. Outside
    stages a signal's default action applies (nothing a restart would miss is written there), but SLURM's notice
    requeues the job (`pretraining.slurm`). DataLoader workers ignore these signals
    (`leave_stop_signals_to_the_main_process`)."""

    def __init__(self, requeue: bool = True) -> None:
        self.requeue = requeue
        self.received: int | None = None  # the signal this rank received
        self.stopped_by: int | None = None  # the signal that stopped training (agreed by all ranks)
        self.previous: dict[int, Any] = {}
        self.boundary_step = -1

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the person means now
        self.received = self.received or signum  # the first signal decides (a SIGTERM is not undone)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Lightning registers its handlers after this hook (and the restore): have it install ours instead.
        install_signal_handlers_instead(trainer, self.install_handlers)
        self.install_handlers()

    def install_handlers(self) -> None:
        if not self.previous:  # not ours already
            self.previous = {signum: signal.signal(signum, self.handle) for signum in SIGNALS}
        if EarlyNotice.received:  # SLURM's notice came before this stage, to a task that does not requeue
            self.received = self.received or NOTICE
            EarlyNotice.received = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.boundary_step = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.boundary_step:
            return  # inside a gradient accumulation: not a step boundary
        self.boundary_step = trainer.global_step
        agreed = self.agreed_signal(trainer)
        if agreed is not None:
            self.save_and_stop(trainer, agreed)
            trainer.should_stop = True

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        agreed = self.agreed_signal(trainer)  # every rank validates the same number of batches
        if agreed is None:
            return
        if self.stopped_by is None:  # not stopped (saved, requeued) at the step boundary before already
            self.save_and_stop(trainer, agreed)
        # Run again on resume where it is owed (`StepCheckpoint`); the one Lightning adds after a stop is not.
        rank_zero_info(f"stopping the validation at step {trainer.global_step}")
        raise Preempted(signal.Signals(agreed).name)

    def save_and_stop(self, trainer: Trainer, agreed: int) -> None:
        """Save the step just completed, once (a validation may precede its save), and requeue if asked to."""
        self.stopped_by = agreed
        name = signal.Signals(agreed).name
        if trainer.state.fn != TrainerFn.FITTING:  # a validation of its own: the weights are saved already
            rank_zero_info(f"{name} received")
        else:
            checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, StepCheckpoint)]
            if checkpoints:
                rank_zero_info(f"{name} received: saving at step {trainer.global_step} and stopping")
            else:
                rank_zero_warn(
                    f"{name} received: stopping at step {trainer.global_step} WITHOUT saving (no StepCheckpoint)"
                )
            for checkpoint in checkpoints:
                checkpoint.save(trainer)
                checkpoint.wait_until_written(trainer)  # within the signal's grace time, before any rank leaves
        self.requeue_job(trainer)
        # No rank leaves before the requeue is made: `srun --kill-on-bad-exit` ends the job at the first exit.
        trainer.strategy.barrier("requeued")

    def requeue_job(self, trainer: Trainer) -> None:
        """With `requeue`, after SLURM's time-limit notice, put the job back in the queue."""
        if trainer.is_global_zero and self.requeue and self.stopped_by == NOTICE and job_to_requeue():
            requeued, message = requeue_this_job()
            (rank_zero_info if requeued else rank_zero_warn)(message)

    def agreed_signal(self, trainer: Trainer) -> int | None:
        """The largest signal any rank received (or None), alike on every rank; one process needs no sync."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.received
        flag = torch.tensor(self.received or 0, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    # Restored when the stage ends (normally, or by an exception, where the teardown hook is not called).
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.restore_handlers()
        if isinstance(exception, Preempted):
            end_training_loaders(trainer)  # Lightning ends only the validation's, the loop that raised

    def restore_handlers(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    @property
    def exit_code(self) -> int:
        """The status to exit with: 0, or 128 + the signal that stopped training (as the shell reports it)."""
        return 128 + self.stopped_by if self.stopped_by else 0


def stop_signal(trainer: Trainer) -> int:
    """0, or 128 + the signal that stopped training (as the shell reports it), as `Preemption` saw it."""
    preemption = [c for c in trainer.callbacks if isinstance(c, Preemption)]  # type: ignore[attr-defined]
    return preemption[0].exit_code if preemption else 0
