"""Checkpoints at step boundaries, through the trainer's writer (`AtomicCheckpointIO`) or, for FSDP2's
sharded checkpoints, written by every rank and published by rank zero (`pretraining.checkpoint`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Any, NoReturn

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn

from pretraining.checkpoint import (
    CheckpointError,
    link_last,
    newest_saved,
    prune,
    publish_sharded,
    read_sidecar,
    record_validation,
    save_sharded_async,
    sidecar_path,
    storage_fault,
)
from pretraining.checkpoint.background import BackgroundWriter, host_copy
from pretraining.files import temporary_path
from pretraining.ranges import Positive, Range, checked_ranges


class StepCheckpoint(Checkpoint):
    """Save every `every_n_steps` optimizer steps and at the last step, always at a step boundary
    (after the optimizer step, so gradient accumulation is respected), through the trainer's
    checkpoint writer (`AtomicCheckpointIO`), or as a sharded directory when the strategy saves
    shards (`save_sharded`). Keep the newest `keep_last` and, permanently, every step divisible by
    `keep_every`. Older ones are pruned only after the new one is complete. At least 2 are kept, so
    that a newest one damaged later (a disk fault, a bad copy) still leaves a fallback.

    A checkpoint is saved before the validation of its step; once that validation finishes, its metrics
    are added to the sidecar (`record_validation`). A run resumed from a checkpoint whose validation a
    kill or a signal cut short validates that step first, so the learning curve has no hole.

    With `background`, the step waits only while the state is copied to host memory; a writer thread
    writes the copy with the same guarantees (`pretraining.checkpoint.background`), and `last.ckpt` and
    pruning follow once it is complete. So on one device, with DDP, and for FSDP2's sharded saves (DCP's
    `async_save`); FSDP1's and FSDP2's full saves are synchronous."""

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
        self.checkpoint_group: dist.ProcessGroup | None = None  # background sharded saves' own collectives
        self.writing_shards = False
        self.saved_step = -1
        self.last_model_path = ""

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # A resumed run does not save again the step it resumed from, and records its validation there.
        resumed = Path(str(trainer.ckpt_path)).resolve()
        if resumed.parent == self.dirpath.resolve():
            self.saved_step, self.last_model_path = checkpoint["global_step"], str(resumed)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.saved_step = trainer.global_step
        if self.last_model_path and validation_owed(trainer, Path(self.last_model_path)):
            validate_in_fit(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning counts the step it logs at one short after restoring a checkpoint saved at a step
        # boundary, until the loop advances: resumed at its last step, it never does, and the final
        # validation would be logged a step early.
        epoch_loop = trainer.fit_loop.epoch_loop
        epoch_loop._batches_that_stepped = max(epoch_loop._batches_that_stepped, trainer.global_step)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Record the validation of the step just saved in its sidecar: see `record_validation`."""
        self.collect(trainer, wait=True)  # the sidecar is written last
        if trainer.sanity_checking or trainer.global_step != self.saved_step or not self.last_model_path:
            return
        if trainer.is_global_zero:
            # All of them (train/, probe/ too): what `fit` returns, for a finished run run again.
            metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
            record_validation(Path(self.last_model_path), metrics)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a smoke test: nothing worth keeping
            return
        self.collect(trainer, wait=False)
        if step % self.every_n_steps == 0 or step >= trainer.max_steps:
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.wait_until_written(trainer)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Made before the first step, so that a gloo that cannot connect stops the run before any work.
        if stage == "fit" and self.writer is not None and saves_sharded(trainer) and self.checkpoint_group is None:
            self.checkpoint_group = dist.new_group(backend="gloo")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.checkpoint_group is not None:
            dist.destroy_process_group(self.checkpoint_group)
            self.checkpoint_group = None

    def wait_until_written(self, trainer: Trainer) -> None:
        """Wait for the checkpoint being written, on every rank: no rank may leave the run (a launcher then
        stops the others) while rank zero writes."""
        self.collect(trainer, wait=True)
        trainer.strategy.barrier("StepCheckpoint.wait_until_written")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run that stops on an error still completes the checkpoint being written: it is where the run continues."""
        self.finish_writing_on_a_stop(trainer)

    def finish_writing_on_a_stop(self, trainer: Trainer) -> None:
        """Complete the checkpoint being written for a run that stops on another error, which is the one to
        report: a failed write only warns."""
        try:
            self.collect(trainer, wait=True)
        except Exception as error:
            rank_zero_warn(f"the checkpoint being written failed too: {error}")

    def save(self, trainer: Trainer) -> None:
        """Save the current step (once), point `last.ckpt` at it and prune (once it is written, in the background)."""
        step = trainer.global_step
        if step == self.saved_step:
            return
        path = self.dirpath / f"step-{step:06d}.ckpt"
        self.collect(trainer, wait=True)  # one write in flight at most
        try:
            if saves_sharded(trainer) and self.writer is not None:
                self.write_shards_in_background(trainer, path)
            elif saves_sharded(trainer):
                save_sharded(trainer, path)
            elif self.writer is not None and writes_on_rank_zero(trainer):
                self.write_in_background(trainer, path)
            else:
                trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank zero writes
        except Exception as error:
            raise_failed(path, error, self.dirpath)
        self.saved_step, self.last_model_path = step, str(path)
        if self.writer is None or self.writer.in_flight is None:
            self.published(trainer, path)

    def write_in_background(self, trainer: Trainer, path: Path) -> None:
        """Rank zero copies the state to host memory and hands the copy to the writer thread. The checkpoint
        is made as `Trainer.save_checkpoint` makes it, whose own write would block: the strategies this
        runs under (`writes_on_rank_zero`) only hand it to their checkpoint writer on rank zero."""
        assert self.writer is not None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if trainer.is_global_zero:
            state, writer = host_copy(checkpoint), trainer.strategy.checkpoint_io
            self.writer.submit(path, lambda: writer.save_checkpoint(state, path))

    def write_shards_in_background(self, trainer: Trainer, path: Path) -> None:
        """Every rank's shards are staged in host memory and written by DCP's thread over the checkpoint
        process group; rank zero publishes the directory once they all are (`save_sharded_async`). The
        checkpoint is split as `ModelParallelStrategy.save_checkpoint` splits it."""
        assert self.writer is not None and self.checkpoint_group is not None
        temporary = Path(trainer.strategy.broadcast(str(temporary_path(path))))  # rank zero's name, on every rank
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        optimizers = enumerate(checkpoint.pop("optimizer_states", []))
        shards = {"state_dict": checkpoint.pop("state_dict")} | {f"optimizer_{i}": state for i, state in optimizers}
        meta = host_copy(checkpoint) if trainer.is_global_zero else None
        self.writer.submit(path, save_sharded_async(shards, meta, temporary, path, self.checkpoint_group))
        self.writing_shards = True

    def collect(self, trainer: Trainer, wait: bool) -> None:
        """Publish the background write once it is complete (waiting for it if `wait`); raise if it failed.
        A sharded write is collected only where every rank waits for it (a save, the end of a validation
        or of training): a failure seen by each rank at its own step would leave the others hanging."""
        if self.writer is None or self.writer.in_flight is None or (self.writing_shards and not wait):
            return
        self.writing_shards = False
        path = self.writer.in_flight
        try:
            written = self.writer.finished(wait)
        except Exception as error:
            raise_failed(path, error, self.dirpath)
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


def validation_owed(trainer: Trainer, resumed: Path) -> bool:
    """Whether the step of the checkpoint resumed from is one the loop validates after, but its
    validation did not finish (a kill or a signal came first). The last step is validated after `fit`."""
    step, batches = trainer.global_step, trainer.global_step * trainer.accumulate_grad_batches
    validates = trainer.val_check_batch not in (None, float("inf")) and batches % trainer.val_check_batch == 0
    sidecar = read_sidecar(resumed)
    return validates and 0 < step < (trainer.max_steps or 0) and "validation" not in sidecar


def validate_in_fit(trainer: Trainer) -> None:
    """Run the validation loop inside `fit`, as Lightning's training loop does after a step (logged at
    the same step): Lightning itself resumes from a checkpoint saved at a step boundary as if the
    validation after that step had finished."""
    trainer.validating = True
    first_loop_iter = trainer._logger_connector._first_loop_iter
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.restarting = False  # from its first batch (a save inside a validation restores its progress)
    val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter


def writes_on_rank_zero(trainer: Trainer) -> bool:
    """Whether rank zero alone writes the whole checkpoint, gathered from no other rank (one device, DDP):
    then the state it holds can be written in the background."""
    return type(trainer.strategy) in (SingleDeviceStrategy, DDPStrategy)


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
