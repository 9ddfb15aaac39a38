"""A run's directory of checkpoints: writing (file, then sidecar), finding the newest that verifies,
`last.ckpt`, pruning and removing."""

from __future__ import annotations

import errno
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from pretraining.checkpoint.sidecar import (
    SIDECAR_FORMAT,
    checkpoint_bytes,
    read_sidecar,
    sidecar_path,
    summary,
    verify,
    write_sidecar,
)
from pretraining.errors import CheckpointError, PretrainingError, StorageError
from pretraining.files import temporary_path, write_durably

LAST_LINK = "last.ckpt"  # a symlink to the newest verified checkpoint, for people (resume never follows it)


def save_file(checkpoint: dict[str, Any], path: Path) -> None:
    """Write `checkpoint` to `path` atomically (see `pretraining.checkpoint`), then its sidecar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = write_durably(path, lambda file: torch.save(checkpoint, file), stale=sidecar_path(path))
    size = path.stat().st_size
    vouch_for(path, {"format": SIDECAR_FORMAT, "sha256": digest, "bytes": size, **summary(checkpoint)})


def vouch_for(path: Path, record: dict[str, Any]) -> None:
    """Write the sidecar of the checkpoint just renamed to `path`; if that fails, remove the unvouched file."""
    try:
        write_sidecar(path, record)
    except BaseException:
        remove(path)
        raise


def record_validation(path: Path, metrics: dict[str, float]) -> None:
    """Add a step's validation metrics to its checkpoint's sidecar (rewritten whole). Saved before its
    validation, a checkpoint otherwise could not tell a finished validation from one a kill interrupted."""
    write_sidecar(path, {**read_sidecar(path), "validation": metrics})


def keep_for_good(path: Path, why: str) -> None:
    """Mark a checkpoint in its sidecar (`keep`: why) so that pruning never removes it."""
    write_sidecar(path, {**read_sidecar(path), "keep": why})


def remove(path: Path) -> None:
    """Delete a checkpoint, its sidecar first, so no sidecar vouches for nothing; a directory is renamed away
    first, so a crash leaves a leftover for pruning, not a partial checkpoint."""
    sidecar_path(path).unlink(missing_ok=True)
    if path.is_dir():
        doomed = temporary_path(path)
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    else:
        path.unlink(missing_ok=True)


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoints in `directory`, files or sharded directories (not the `last.ckpt` link)."""
    return [path for path in directory.glob("*.ckpt") if not path.is_symlink()] if directory.is_dir() else []


def sidecar_step(path: Path) -> tuple[int | None, Any]:
    """The step and size a checkpoint's sidecar records (None, None without a readable sidecar)."""
    try:
        record = read_sidecar(path)
    except (OSError, ValueError):
        return None, None
    step = record.get("step") if isinstance(record, dict) else None
    return (step, record.get("bytes")) if isinstance(step, int) else (None, None)


def saved_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints whose sidecar gives their size, newest first (not checksummed)."""
    found = []
    for path in checkpoint_files(directory):
        step, size = sidecar_step(path)
        if step is not None and checkpoint_bytes(path) == size:
            found.append((step, path))
    return sorted(found, reverse=True)


def newest_verified(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, and its sidecar, warning about each skipped; None if there is none.
    A single one without a sidecar is a save a kill cut off (one is written at a time): skipped. If some exist
    but none verifies, refuse: starting over would silently discard them. Newest is the sidecar's step, not
    the name (which sorts wrongly past step 999999); those without a readable sidecar are tried first."""

    def newest_first(path: Path) -> tuple[float, str]:
        step, _ = sidecar_step(path)
        return (math.inf if step is None else step, path.name)

    checkpoints = sorted(checkpoint_files(directory), key=newest_first, reverse=True)
    unvouched = [path for path in checkpoints if not sidecar_path(path).exists()]
    problems = []
    for path in checkpoints:
        if unvouched == [path]:
            warnings.warn(
                f"{path} has no sidecar {sidecar_path(path).name}, which a save writes last: ignoring it as a save "
                "that did not finish (a kill cut it off)",
                stacklevel=2,
            )
            continue
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


def newest_saved(directory: Path) -> str:
    """Where a run stopped by a failed save continues from, in words."""
    saved = saved_checkpoints(directory)
    return f"the newest complete checkpoint, {saved[0][1]}, is intact" if saved else "no checkpoint was saved before"


# A file system refusing a read or write (full, quota, read-only, permissions, I/O, a stale mount).
STORAGE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EFBIG,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EIO,
    errno.ESTALE,
}


@contextmanager
def storage_faults_stop_the_run(checkpoints: Path) -> Iterator[None]:
    """Turn a file system's refusal of any read or write of the run into one line: what was kept, how to go on."""
    try:
        yield
    except PretrainingError:
        raise
    except Exception as error:
        fault = storage_fault(error)
        if fault is None or fault.errno not in STORAGE_ERRNOS:
            raise
        raise StorageError(
            f"the run stopped: {fault}. Nothing was lost: {newest_saved(checkpoints)}. Fix the file system (free "
            "space, permissions, the mount), then run the same command to continue"
        ) from error


def link_last(path: Path) -> None:
    """Point `last.ckpt` at `path`, atomically."""
    temporary = temporary_path(path.with_name(LAST_LINK))
    temporary.symlink_to(path.name)
    os.replace(temporary, path.with_name(LAST_LINK))


def prune(directory: Path, keep_last: int, keep_every: int | None, keep: Path) -> None:
    """Remove all checkpoints but `keep`, the newest `keep_last`, steps divisible by `keep_every` and those
    marked `keep_for_good`; then what crashed saves left behind."""
    checkpoints = saved_checkpoints(directory)
    newest = {path for _, path in checkpoints[:keep_last]} | {keep}
    for step, path in checkpoints:
        permanent = keep_every is not None and step % keep_every == 0
        if path not in newest and not permanent and "keep" not in read_sidecar(path):
            remove(path)
    for leftover in directory.glob(".*.tmp-*"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink(missing_ok=True)


def storage_fault(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if any: `torch.save` and DCP wrap it in their own errors."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        if isinstance(seen, dcp.api.CheckpointException):  # DCP collects each rank's error
            return next(filter(None, (storage_fault(failure) for failure, _ in seen.failures.values())), None)
        seen = seen.__cause__ or seen.__context__
    return None
