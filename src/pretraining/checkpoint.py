"""Checkpoints that are never half-written, and the search for the newest good one.

A checkpoint `step-000200.ckpt` is written to a temporary file in the same
directory, fsynced, read back for its SHA-256, renamed into place, and the
directory fsynced; then its sidecar `step-000200.ckpt.json` (checksum, size,
step, lineage, parameter shapes) is written the same way, last. A checkpoint
counts only once its sidecar exists and its bytes match it, so a crash at any
moment leaves either the previous good checkpoint or the new good one, never a
torn file that a resume would trust. Resume takes the newest that verifies.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint

SIDECAR_FORMAT = 1
LAST_LINK = "last.ckpt"  # a symlink to the newest verified checkpoint, for people (resume never follows it)


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or does not fit the run; the message says which and what to do."""


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Any) -> str:
    """Write a file through `write(file)` to a temporary name beside `path`, fsync, rename into
    place, fsync the directory; return its SHA-256, read back from disk before the rename."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with temporary.open("wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        digest = sha256_of(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return digest


def parameter_shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in state_dict.items()}


def summary(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a resume checks before loading a checkpoint: its step, lineage (without the full config)
    and parameter shapes."""
    lineage = {key: value for key, value in checkpoint.get("lineage", {}).items() if key != "config"}
    shapes = parameter_shapes(checkpoint.get("state_dict", {}))
    return {"step": checkpoint.get("global_step"), "lineage": lineage, "parameters": shapes}


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer and reader, made atomic and verified (see module doc)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sidecar_path(path).unlink(missing_ok=True)  # the old sidecar must not vouch for new bytes
        digest = write_durably(path, lambda file: torch.save(checkpoint, file))
        record = {"format": SIDECAR_FORMAT, "sha256": digest, "bytes": path.stat().st_size, **summary(checkpoint)}
        write_durably(sidecar_path(path), lambda file: file.write(json.dumps(record, indent=1).encode()))

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        verify(Path(path))
        # Tensors and plain data only: a checkpoint from elsewhere cannot run code. Onto the CPU unless
        # told otherwise: every rank loads the file, and a GPU's copy would land on the saver's device.
        return super().load_checkpoint(path, map_location=map_location or on_cpu, weights_only=True)

    def remove_checkpoint(self, path: Any) -> None:
        remove(Path(path))


def on_cpu(storage: Any, location: str) -> Any:
    """A `torch.load` map_location that keeps every tensor on the CPU."""
    return storage


def remove(path: Path) -> None:
    """Delete a checkpoint, its sidecar first, so that no moment leaves a sidecar vouching for nothing."""
    sidecar_path(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def verify(path: Path) -> dict[str, Any]:
    """The sidecar of a complete, intact checkpoint; raises `CheckpointError` naming what is wrong.
    A file already verified in this process, unchanged since, is not read again."""
    path = path.resolve()
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found" + (" (it is a directory)" if path.is_dir() else ""))
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise CheckpointError(
            f"{path} has no sidecar {sidecar.name}, which is written last: its save did not finish, the sidecar was "
            f"not copied with it, or it predates sidecars (such a checkpoint can still be evaluated, not resumed); "
            f"use another checkpoint"
        )
    try:
        record = json.loads(sidecar.read_text())
        written, expected_bytes, expected_sha = record["format"], record["bytes"], record["sha256"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"sidecar {sidecar} is unreadable ({error!r}); use another checkpoint") from None
    if written != SIDECAR_FORMAT:
        raise CheckpointError(f"sidecar {sidecar} has format {written}, this code reads {SIDECAR_FORMAT}")
    stat = path.stat()
    if stat.st_size != expected_bytes:
        raise CheckpointError(
            f"{path} has {stat.st_size} bytes, its sidecar says {expected_bytes}: it is truncated or altered; "
            f"use another checkpoint in {path.parent}"
        )
    key = (path, stat.st_size, stat.st_mtime_ns, expected_sha)
    if key not in _verified:
        if sha256_of(path) != expected_sha:
            raise CheckpointError(
                f"{path} does not match the SHA-256 in its sidecar: it is corrupt; "
                f"use another checkpoint in {path.parent}"
            )
        _verified.add(key)
    return record


_verified: set[tuple[Path, int, int, str]] = set()


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoint files in `directory` (not the `last.ckpt` link)."""
    return [path for path in directory.glob("*.ckpt") if not path.is_symlink()] if directory.is_dir() else []


def sidecar_step(path: Path) -> tuple[int | None, Any]:
    """The step and size a checkpoint's sidecar records (None, None without a readable sidecar)."""
    try:
        record = json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError):
        return None, None
    step = record.get("step") if isinstance(record, dict) else None
    return (step, record.get("bytes")) if isinstance(step, int) else (None, None)


def saved_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints in `directory` whose sidecar exists and gives their size,
    newest first (not yet checksummed)."""
    found = []
    for path in checkpoint_files(directory):
        step, size = sidecar_step(path)
        if step is not None and path.stat().st_size == size:
            found.append((step, path))
    return sorted(found, reverse=True)


def newest_verified(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that verifies, and its sidecar, warning about each one
    skipped; None if the directory holds no checkpoint. If it holds some but none verifies, refuse
    (starting over would silently discard them). Newest means the step the sidecar records, not the
    file name (names sort wrongly past step 999999); those without a readable sidecar are tried, and
    reported, first."""

    def newest_first(path: Path) -> tuple[float, str]:
        step, _ = sidecar_step(path)
        return (math.inf if step is None else step, path.name)

    problems = []
    for path in sorted(checkpoint_files(directory), key=newest_first, reverse=True):
        try:
            return path, verify(path)
        except CheckpointError as error:
            warnings.warn(f"ignoring a checkpoint that does not verify, trying an older one: {error}", stacklevel=2)
            problems.append(str(error))
    if problems:
        raise CheckpointError(
            f"no checkpoint in {directory} verifies:\n  " + "\n  ".join(problems) + "\npass ckpt_path=<a checkpoint "
            "you trust>, restore the missing sidecars, or pass resume=never to move these aside and start over"
        )
    return None


class StepCheckpoint(Checkpoint):
    """Save every `every_n_steps` optimizer steps and at the last step, always at a step boundary
    (after the optimizer step, so gradient accumulation is respected), through the trainer's
    checkpoint writer (`AtomicCheckpointIO`). Keep the newest `keep_last` and, permanently, every
    step divisible by `keep_every`. Older ones are pruned only after the new one is complete. At
    least 2 are kept, so that a newest one damaged later (a disk fault, a bad copy) still leaves a
    fallback."""

    def __init__(
        self, dirpath: str, every_n_steps: int = 200, keep_last: int = 2, keep_every: int | None = None
    ) -> None:
        if every_n_steps < 1 or keep_last < 2 or (keep_every is not None and keep_every < 1):
            raise ValueError(
                f"callbacks.checkpoint: every_n_steps={every_n_steps} must be >= 1, keep_last={keep_last} >= 2 and "
                f"keep_every={keep_every} null or >= 1"
            )
        self.dirpath, self.every_n_steps = Path(dirpath), every_n_steps
        self.keep_last, self.keep_every = keep_last, keep_every
        self.saved_step = -1
        self.last_model_path = ""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.saved_step = trainer.global_step  # a resumed run does not save again the step it resumed from

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run:  # type: ignore[attr-defined]  # a smoke test: nothing worth keeping
            return
        if step % self.every_n_steps == 0 or step >= trainer.max_steps:
            self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        """Save the current step (once), verify it, point `last.ckpt` at it and prune."""
        step = trainer.global_step
        if step == self.saved_step:
            return
        path = self.dirpath / f"step-{step:06d}.ckpt"
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank zero writes
        self.saved_step, self.last_model_path = step, str(path)
        if trainer.is_global_zero:
            if not sidecar_path(path).is_file():  # the writer verified the bytes it wrote before its sidecar
                raise CheckpointError(
                    f"{path} was saved without a sidecar: the checkpoint was not written by AtomicCheckpointIO "
                    f"(trainer.plugins), or the strategy bypasses it (FSDP with save_distributed_checkpoint=true "
                    f"writes sharded directories, which resume does not support yet: set it to false)"
                )
            link_last(path)
            self.prune(keep=path)

    def prune(self, keep: Path) -> None:
        checkpoints = saved_checkpoints(self.dirpath)
        newest = {path for _, path in checkpoints[: self.keep_last]} | {keep}
        for step, path in checkpoints:
            permanent = self.keep_every is not None and step % self.keep_every == 0
            if path not in newest and not permanent:
                remove(path)
        for leftover in self.dirpath.glob(".*.tmp-*"):  # what a save interrupted by a crash left behind
            leftover.unlink(missing_ok=True)


def link_last(path: Path) -> None:
    """Point `last.ckpt` at `path`, atomically."""
    link = path.with_name(LAST_LINK)
    temporary = path.with_name(f".{LAST_LINK}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(path.name)
    os.replace(temporary, link)
