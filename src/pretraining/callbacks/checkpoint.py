"""Checkpoints at step boundaries: `AtomicCheckpointIO` (or `FSDP2Strategy`, for shards) writes each one whole
or not at all (`pretraining.checkpoint`); this callback decides when, and publishes it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint, Timer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from pretraining.checkpoint import (
    CheckpointError,
    link_last,
    newest_saved,
    prune,
    record_validation,
    sidecar_path,
    storage_fault,
)
from pretraining.checkpoint.background import BackgroundWriter
from pretraining.errors import ConfigError
from pretraining.objectives.base import PretrainingObjective, logged_values
from pretraining.plugins import fsdp2_strategy
from pretraining.plugins.checkpoint_io import AtomicCheckpointIO
from pretraining.ranges import Positive, Range, checked_ranges


class StepCheckpoint(Checkpoint):
    """Save every `every_n_steps` optimizer steps, at the last step and where training stops early, always
    at a step boundary (a stop asked for inside a gradient accumulation waits for the step's end), so that a
    checkpoint holds whole steps. Keep the newest `keep_last` (at least 2: a fallback if the newest is damaged
    later) and every step divisible by `keep_every`; prune only once the new one is complete.

    A step that Lightning validates in training by its schedule is saved at the end of that validation, once the
    callbacks acting on it have (Lightning's `EarlyStopping`, and `ModelCheckpoint`, which
    `pretraining.run.build_trainer` orders before this one): what they keep resumes as if the run had never
    stopped. Its metrics then join its sidecar (`record_validation`). A stop off the schedule (a time limit, a
    budget) saves at the step boundary, before the validation Lightning runs at a stop: a run never stopped has
    none there. A signal saves at the step boundary (or inside the validation), before the validation, and the
    continued run validates that step first (`pretraining.run.fit`). A run that `EarlyStopping` stopped stays
    stopped when run again. With `background`, a step not validated waits only for the copy to host memory (a
    validated one for the write too, to record its validation); a writer thread
    (`pretraining.checkpoint.background`, passed as `storage_options`) writes it with the same guarantees
    (one device, DDP, FSDP2; FSDP1 saves synchronously). Not `ModelCheckpoint`: it verifies nothing before a
    resume trusts it, cannot record a validation after saving, and prunes before the newer save is complete."""

    @checked_ranges("callbacks.checkpoint")
    def __init__(
        self,
        dirpath: str,
        every_n_steps: Positive = 200,
        keep_last: Annotated[int, Range(ge=2, why="a newest checkpoint damaged later then leaves a fallback")] = 2,
        keep_every: Positive | None = None,
        background: bool = True,
    ) -> None:
        self.dirpath, self.every_n_steps = Path(dirpath), every_n_steps
        self.keep_last, self.keep_every = keep_last, keep_every
        self.writer = BackgroundWriter() if background else None
        self.writing_shards = False
        self.saved_step = self.boundary_step = -1
        self.due_step = -1  # a step to save at the end of its validation
        self.stop_requested = False  # asked for inside a gradient accumulation: obeyed at the step's end
        self.last_model_path = ""
        self.validated_path: Path | None = None  # the checkpoint whose validation was just recorded
        self.saving_seconds = 0.0  # this process's time waiting on saves (a goodput account reads it)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse, before any step, a checkpoint IO other than `AtomicCheckpointIO`: no checkpoint would resume."""
        checkpoint_io = trainer.strategy.checkpoint_io
        if not saves_sharded(trainer) and not isinstance(checkpoint_io, AtomicCheckpointIO):
            raise ConfigError(
                f"callbacks.checkpoint saves through {type(checkpoint_io).__name__}, not AtomicCheckpointIO, which "
                "writes each checkpoint with its sidecar (background saves are callbacks.checkpoint's own): keep "
                "pretraining.plugins.checkpoint_io.AtomicCheckpointIO in trainer.plugins (configs/trainer/default.yaml)"
            )

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A resumed run does not save again the step it resumed from, and records its validation there.
        resumed = Path(str(trainer.ckpt_path)).resolve()
        if resumed.parent == self.dirpath.resolve():
            self.saved_step, self.last_model_path = checkpoint["global_step"], str(resumed)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.saved_step = self.boundary_step = trainer.global_step
        self.stop_requested = False
        stop = early_stopped(trainer)
        # Lightning restores the callback, not its stop: the run would train another interval. Any rank's stop.
        if trainer.strategy.reduce_boolean_decision(stop is not None, all=False):
            rank_zero_info(
                f"EarlyStopping stopped this run at step {trainer.global_step} ({stop or 'on another rank'}); it "
                "stays stopped. To train on, remove that callback, or pass resume=never to start over"
            )
            trainer.should_stop = True

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Save the step due or asked to stop (EarlyStopping), now that this validation's callbacks have acted,
        then record the validation of the step just saved in its sidecar (`record_validation`)."""
        in_training = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if in_training and (trainer.should_stop or self.due_step == trainer.global_step):
            self.save(trainer)
        self.collect(trainer, wait=True)  # the sidecar is written last
        validated = pl_module.trained_steps if isinstance(pl_module, PretrainingObjective) else trainer.global_step
        self.validated_path = None
        if trainer.sanity_checking or validated != self.saved_step or not self.last_model_path:
            return
        self.validated_path = Path(self.last_model_path)
        if trainer.is_global_zero:
            # All of them (train/, probe/ too): what `fit` returns, for a finished run run again.
            record_validation(self.validated_path, logged_values(trainer.callback_metrics))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Save every `every_n_steps`, at the last step and where training stops (this hook runs after the
        other callbacks'): at once, or at the end of the validation that follows (`on_validation_end`)."""
        step = trainer.global_step
        if step == self.boundary_step:  # inside a gradient accumulation
            self.defer_stop(trainer)
            return
        if self.due_step > self.saved_step:  # a Lightning that no longer validates as `validated_at` says
            rank_zero_warn(f"step {self.due_step} was not saved: the validation expected after it did not run")
            self.due_step = -1
        self.boundary_step = step
        trainer.should_stop |= self.stop_requested
        self.stop_requested = False
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a smoke test: nothing worth keeping
            return
        self.collect(trainer, wait=False)
        if step % self.every_n_steps == 0 or step >= trainer.max_steps or trainer.should_stop:
            if trainer.enable_validation and validated_at(trainer, step):
                self.due_step = step
            else:
                self.save(trainer)

    def defer_stop(self, trainer: Trainer) -> None:
        """Inside a gradient accumulation, defer a stop to the step's end: the data position is a step's."""
        self.stop_requested |= trainer.should_stop
        trainer.should_stop = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.fast_dev_run:  # type: ignore[attr-defined]
            self.save(trainer)  # an end no hook above saw: the last epoch of `trainer.max_epochs`, say
        self.wait_until_written(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # trainer.max_time limits each job of a chain, as a scheduler's limit does: a continued run has it all again.
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, Timer):
                checkpoint["callbacks"].pop(callback.state_key, None)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.writer is not None:
            self.writer.close()

    def wait_until_written(self, trainer: Trainer) -> None:
        """Wait for the write on every rank: a rank leaving early makes the launcher stop rank zero mid-write."""
        self.collect(trainer, wait=True)
        trainer.strategy.barrier("StepCheckpoint.wait_until_written")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run that stops on an error still completes the checkpoint being written: it is where the run continues."""
        self.finish_writing_on_a_stop(trainer)

    def finish_writing_on_a_stop(self, trainer: Trainer) -> None:
        """Complete the write for a run stopping on another error, the one to report: a failed write only warns."""
        try:
            self.collect(trainer, wait=True)
        except Exception as error:
            rank_zero_warn(f"the checkpoint being written failed too: {error}")

    def save(self, trainer: Trainer) -> None:
        """Save the current step once; `last.ckpt` and pruning follow once it is written."""
        step = trainer.global_step
        if step == self.saved_step:
            return
        path = self.dirpath / f"step-{step:06d}.ckpt"
        self.collect(trainer, wait=True)  # one write in flight at most
        writer = self.writer if writes_through_storage_options(trainer) else None
        started = time.perf_counter()
        try:
            trainer.save_checkpoint(path, weights_only=False, storage_options=writer)
        except Exception as error:
            raise_failed(path, error, self.dirpath)
        finally:
            self.saving_seconds += time.perf_counter() - started
        self.writing_shards = writer is not None and saves_sharded(trainer)
        self.saved_step, self.last_model_path = step, str(path)
        if writer is None or writer.in_flight is None:
            self.published(trainer, path)

    def collect(self, trainer: Trainer, wait: bool) -> None:
        """Publish the background write once complete (waiting if `wait`); raise if it failed. A sharded write
        is collected only where every rank waits: a failure seen at different steps would hang the others."""
        if self.writer is None or self.writer.in_flight is None or (self.writing_shards and not wait):
            return
        self.writing_shards = False
        path, started = self.writer.in_flight, time.perf_counter()
        try:
            written = self.writer.finished(wait)
        except Exception as error:
            raise_failed(path, error, self.dirpath)
        finally:
            self.saving_seconds += time.perf_counter() - started
        if written is not None:
            self.published(trainer, written)

    def published(self, trainer: Trainer, path: Path) -> None:
        """Once `path` is written: point `last.ckpt` at it, prune, and tell the loggers (rank zero)."""
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


def validated_at(trainer: Trainer, step: int) -> bool:
    """Whether Lightning validates step `step` in training by its schedule: every `val_check_interval`
    micro-batches (an int, set in micro-batches by `pretraining.run.build_trainer`), in the epochs it validates."""
    every, epochs = trainer.val_check_interval, trainer.check_val_every_n_epoch
    in_epoch = epochs is None or (trainer.current_epoch + 1) % epochs == 0
    return isinstance(every, int) and in_epoch and (step * trainer.accumulate_grad_batches) % every == 0


def early_stopped(trainer: Trainer) -> str | None:
    """Why one of Lightning's `EarlyStopping` callbacks stopped this run, as restored from its checkpoint (set
    only by a stop; Lightning 2.5 keeps no such record, and its runs train on)."""
    reasons = [getattr(callback, "stopping_reason_message", None) for callback in trainer.early_stopping_callbacks]
    return next((reason.strip() for reason in reasons if reason), None)


def raise_failed(path: Path, error: Exception, directory: Path) -> NoReturn:
    """Stop the run on a failed save: for a storage fault, saying what was kept and what to do."""
    storage = storage_fault(error)
    if storage is None:
        raise error
    raise CheckpointError(
        f"saving {path} failed: {storage}. Nothing was lost: {newest_saved(directory)}. Free space on "
        f"that disk or make {directory} writable (or point paths.log_dir elsewhere and pass "
        f"ckpt_path=<that checkpoint>), then run the same command to continue"
    ) from error


def writes_through_storage_options(trainer: Trainer) -> bool:
    """Whether the strategy passes `storage_options` on to the writer, which then writes in the background."""
    return type(trainer.strategy) in (SingleDeviceStrategy, DDPStrategy) or fsdp2_strategy(trainer.strategy) is not None


def saves_sharded(trainer: Trainer) -> bool:
    """Whether every rank writes its shards of each checkpoint (FSDP2 with `save_distributed_checkpoint=true`)."""
    fsdp2 = fsdp2_strategy(trainer.strategy)
    return fsdp2 is not None and fsdp2.sharded_saves
