"""Stop cleanly when asked to: SIGTERM (schedulers), SIGUSR1 (SLURM's warning) or Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from pretraining.checkpoint import StepCheckpoint

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1", "SIGINT") if hasattr(signal, name))


class Preemption(Callback):
    """On a signal, only set a flag; at the next step boundary the ranks agree on it (all-reduce of
    the flag), save a checkpoint, stop, and `train` exits with status 128 + signal number, which a
    scheduler can requeue on. With `requeue` and under SLURM, rank zero also runs
    `scontrol requeue` after the save. Nothing is saved inside the handler: the state is always that
    of a completed optimizer step. A second Ctrl-C stops at once, without saving.

    Installed at the start of training, replacing Lightning's handlers (whose SIGTERM path runs a
    collective inside the handler and can hang a DDP job).
    """

    def __init__(self, requeue: bool = True) -> None:
        self.requeue = requeue
        self.received: int | None = None  # the signal this rank received
        self.stopped_by: int | None = None  # the signal that stopped training (agreed by all ranks)
        self.previous: dict[int, Any] = {}
        self.boundary_step = -1

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the person means now
        self.received = signum

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.boundary_step = trainer.global_step
        self.previous = {signum: signal.signal(signum, self.handle) for signum in SIGNALS}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step == self.boundary_step:
            return  # inside a gradient accumulation: not a step boundary
        self.boundary_step = trainer.global_step
        agreed = self.agreed_signal(trainer)
        if agreed is None:
            return
        self.stopped_by = agreed
        rank_zero_info(f"{signal.Signals(agreed).name} received: saving at step {trainer.global_step} and stopping")
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, StepCheckpoint):
                checkpoint.save(trainer)
        trainer.should_stop = True
        if trainer.is_global_zero and self.requeue and "SLURM_JOB_ID" in os.environ:
            requeue_slurm_job(os.environ["SLURM_JOB_ID"])

    def agreed_signal(self, trainer: Trainer) -> int | None:
        """The largest signal number any rank received (0 for none), the same on every rank."""
        flag = torch.tensor(self.received or 0, device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) or None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    @property
    def exit_code(self) -> int:
        """The status to exit with: 0, or 128 + the signal that stopped training (as the shell reports it)."""
        return 128 + self.stopped_by if self.stopped_by else 0


def requeue_slurm_job(job_id: str) -> None:
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode == 0:
        rank_zero_info(f"requeued SLURM job {job_id}")
    else:
        rank_zero_warn(f"could not requeue SLURM job {job_id}: {result.stderr.strip()}")
