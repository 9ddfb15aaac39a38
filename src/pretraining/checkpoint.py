"""Checkpoints that are never half-written, and the search for the newest good one.

A checkpoint `step-000200.ckpt` is written to a temporary file in the same
directory, fsynced, read back for its SHA-256, renamed into place, and the
directory fsynced; then its sidecar `step-000200.ckpt.json` (checksum, size,
step, lineage, parameter shapes) is written the same way, last. A checkpoint
counts only once its sidecar exists and its bytes match it, so a crash at any
moment leaves either the previous good checkpoint or the new good one, never a
torn file that a resume would trust. Resume takes the newest that verifies.

A sharded checkpoint (FSDP2 with `save_distributed_checkpoint=true`) is a
directory of the same name: every rank writes its shards into a temporary
directory beside it, and once all have finished, rank zero checksums every
file, renames the directory into place and writes the sidecar (which lists each
file's size and SHA-256) last, with the same guarantees.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.load import _METADATA_FILENAME as SHARDED_META  # meta.pt: all but weights, optimizer
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from pretraining.files import fsync_directory, sha256_of, temporary_path, write_durably

SIDECAR_FORMAT = 1
LAST_LINK = "last.ckpt"  # a symlink to the newest verified checkpoint, for people (resume never follows it)


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or does not fit the run; the message says which and what to do."""


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def write_sidecar(path: Path, record: dict[str, Any]) -> None:
    write_durably(sidecar_path(path), lambda file: file.write(json.dumps(record, indent=1).encode()))


def vouch_for(path: Path, record: dict[str, Any]) -> None:
    """Write the sidecar of the checkpoint just renamed to `path`; if that fails (a full disk), remove
    the checkpoint: complete but not vouched for, it is not worth the space it takes."""
    try:
        write_sidecar(path, record)
    except BaseException:
        remove(path)
        raise


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
        digest = write_durably(path, lambda file: torch.save(checkpoint, file), stale=sidecar_path(path))
        size = path.stat().st_size
        vouch_for(path, {"format": SIDECAR_FORMAT, "sha256": digest, "bytes": size, **summary(checkpoint)})

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
    """Delete a checkpoint, its sidecar first, so that no moment leaves a sidecar vouching for nothing.
    A directory is renamed to a temporary name first: a crash while deleting it leaves a leftover for
    pruning, not a partial checkpoint under its name."""
    sidecar_path(path).unlink(missing_ok=True)
    if path.is_dir():
        doomed = temporary_path(path)
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    else:
        path.unlink(missing_ok=True)


def files_under(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()}


def checkpoint_bytes(path: Path) -> int:
    """The size of a checkpoint file, or the total size of a sharded checkpoint's files."""
    return sum(file.stat().st_size for file in files_under(path)) if path.is_dir() else path.stat().st_size


def listed_files(path: Path, record: dict[str, Any]) -> dict[Path, tuple[int, str]]:
    """Each file of a checkpoint with the size and SHA-256 its sidecar records: the checkpoint file
    itself, or every file of a sharded checkpoint's directory."""
    if path.is_dir():
        return {path / name: (entry["bytes"], entry["sha256"]) for name, entry in record["files"].items()}
    return {path: (record["bytes"], record["sha256"])}


def verify(path: Path) -> dict[str, Any]:
    """The sidecar of a complete, intact checkpoint (a file, or a directory of shards); raises
    `CheckpointError` naming what is wrong. A file already verified in this process, unchanged since,
    is not read again."""
    path = path.resolve()
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} not found")
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise CheckpointError(
            f"{path} has no sidecar {sidecar.name}, which is written last: its save did not finish, the sidecar was "
            f"not copied with it, or it predates sidecars (such a checkpoint can still be evaluated, not resumed); "
            f"use another checkpoint"
        )
    try:
        record = json.loads(sidecar.read_text())
        written, expected = record["format"], listed_files(path, record)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"sidecar {sidecar} is unreadable ({error!r}); use another checkpoint") from None
    if written != SIDECAR_FORMAT:
        raise CheckpointError(f"sidecar {sidecar} has format {written}, this code reads {SIDECAR_FORMAT}")
    unlisted = sorted(files_under(path) - expected.keys()) if path.is_dir() else []
    if unlisted:
        raise CheckpointError(
            f"{unlisted[0]} is not listed in the sidecar {sidecar.name}: something wrote into the checkpoint after "
            f"its save; use another checkpoint in {path.parent}"
        )
    for file, (size, sha) in expected.items():
        verify_file(file, size, sha, path.parent)
    return record


def verify_file(file: Path, expected_bytes: int, expected_sha: str, checkpoints: Path) -> None:
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing: the checkpoint is incomplete; use another checkpoint in {checkpoints}"
        )
    stat = file.stat()
    if stat.st_size != expected_bytes:
        raise CheckpointError(
            f"{file} has {stat.st_size} bytes, its sidecar says {expected_bytes}: it is truncated or altered; "
            f"use another checkpoint in {checkpoints}"
        )
    key = (file, stat.st_size, stat.st_mtime_ns, expected_sha)
    if key not in _verified:
        if sha256_of(file) != expected_sha:
            raise CheckpointError(
                f"{file} does not match the SHA-256 in its sidecar: it is corrupt; "
                f"use another checkpoint in {checkpoints}"
            )
        _verified.add(key)


_verified: set[tuple[Path, int, int, str]] = set()


def checkpoint_files(directory: Path) -> list[Path]:
    """The checkpoints in `directory`, files or sharded directories (not the `last.ckpt` link)."""
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
        if step is not None and checkpoint_bytes(path) == size:
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


# --- sharded checkpoints: a directory of torch.distributed.checkpoint (DCP) files and meta.pt ---------------

MODEL_KEY = "state_dict"  # Lightning saves the weights under this key; DCP flattens them to "state_dict.<name>"
DCP_METADATA = ".metadata"  # DCP's pickled index of every tensor's shards


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


def publish_sharded(temporary: Path, path: Path) -> None:
    """Fsync and checksum each file of the complete directory `temporary`, rename it to `path`, and
    write its sidecar last."""
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(files_under(temporary)):
        with file.open("rb") as opened:  # written by any rank (meta.pt without an fsync)
            os.fsync(opened.fileno())
        files[file.relative_to(temporary).as_posix()] = {"bytes": file.stat().st_size, "sha256": sha256_of(file)}
    listing = "".join(f"{entry['sha256']}  {name}\n" for name, entry in files.items())  # as `sha256sum` prints it
    record = {
        "format": SIDECAR_FORMAT,
        "sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "bytes": sum(entry["bytes"] for entry in files.values()),
        "files": files,
        **sharded_summary(temporary),
    }
    fsync_directory(temporary)
    remove(path)  # the same step saved before but cut off after its rename; the old sidecar must not vouch for it
    os.replace(temporary, path)
    fsync_directory(path.parent)
    vouch_for(path, record)


def sharded_summary(directory: Path) -> dict[str, Any]:
    meta = torch.load(directory / SHARDED_META, map_location="cpu", weights_only=True)
    index = WeightsOnlyReader(directory).read_metadata()
    shapes = {name: list(tensor.size) for name, tensor in model_tensors(index).items()}
    return {**summary(meta), "parameters": shapes}


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in a DCP index (not the optimizer's), by parameter name."""
    prefix = f"{MODEL_KEY}."
    return {
        key.removeprefix(prefix): entry
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }


def load_sharded(directory: Path) -> dict[str, Any]:
    """A sharded checkpoint as one checkpoint dict, in this process (no process group): meta.pt's state
    and the model's full weights, gathered from every rank's shards (not the optimizer's state). Nothing
    in it can run code: meta.pt loads weights-only, and the shard index through `MetadataUnpickler`."""
    reader = WeightsOnlyReader(directory)
    tensors = model_tensors(reader.read_metadata())
    state = {
        MODEL_KEY: {name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in tensors.items()}
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # one process is the intent
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {**torch.load(directory / SHARDED_META, map_location="cpu", weights_only=True), **state}


def load_sharded_into(module: nn.Module, optimizers: list[Optimizer], directory: Path, strict: bool) -> dict[str, Any]:
    """Restore the FSDP2 `module` and its `optimizers` from a sharded checkpoint, each rank reading its own
    shards, and return meta.pt's state (the rest of the checkpoint). Lightning's loader does the same but
    unpickles the shard index; here nothing in the checkpoint can run code."""
    WeightsOnlyReader(directory).read_metadata()  # an unsafe index refused in our words, before DCP wraps them
    model_state = {MODEL_KEY: get_model_state_dict(module)}
    dcp.load(model_state, storage_reader=WeightsOnlyReader(directory))
    module.load_state_dict(model_state[MODEL_KEY], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"  # as Lightning saves them
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        dcp.load(optimizer_state, storage_reader=WeightsOnlyReader(directory))
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return torch.load(directory / SHARDED_META, map_location="cpu", weights_only=True)


class WeightsOnlyReader(dcp.FileSystemReader):
    """DCP's reader, reading its index with `MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = Path(self.path) / DCP_METADATA
        with index.open("rb") as file:
            try:
                metadata = MetadataUnpickler(file).load()
            except pickle.UnpicklingError as error:
                raise CheckpointError(f"{index} cannot be read: {error}; use another checkpoint") from None
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as the base class does
        return metadata


# What a DCP index is made of: its dataclasses, tensor sizes, dtypes and layouts, and the path it was saved to.
SAFE_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")),
}


def safe_enum_member(cls: Any, name: str) -> Any:
    """`getattr(cls, name)` as an index may use it: only for a member of an allowed enum."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum)
    if not allowed or (cls.__module__, cls.__qualname__) not in SAFE_METADATA_GLOBALS or name not in cls.__members__:
        raise pickle.UnpicklingError(f"it calls getattr({cls!r}, {name!r}), which could run code")
    return cls[name]


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP index allowing only `SAFE_METADATA_GLOBALS` and dtypes, so that a checkpoint from
    elsewhere cannot run code (what `weights_only=True` does for `torch.load`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):  # how some Pythons pickle an enum member
            return safe_enum_member
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in SAFE_METADATA_GLOBALS and not dtype:
            raise pickle.UnpicklingError(
                f"it refers to {module}.{name}, which a checkpoint's index never holds and which could run code"
            )
        return super().find_class(module, name)


class StepCheckpoint(Checkpoint):
    """Save every `every_n_steps` optimizer steps and at the last step, always at a step boundary
    (after the optimizer step, so gradient accumulation is respected), through the trainer's
    checkpoint writer (`AtomicCheckpointIO`), or as a sharded directory when the strategy saves
    shards (`save_sharded`). Keep the newest `keep_last` and, permanently, every step divisible by
    `keep_every`. Older ones are pruned only after the new one is complete. At least 2 are kept, so
    that a newest one damaged later (a disk fault, a bad copy) still leaves a fallback."""

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
        """Save the current step (once), point `last.ckpt` at it and prune."""
        step = trainer.global_step
        if step == self.saved_step:
            return
        path = self.dirpath / f"step-{step:06d}.ckpt"
        try:
            if saves_sharded(trainer):
                save_sharded(trainer, path)
            else:
                trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; rank zero writes
        except Exception as error:
            storage = storage_fault(error)
            if storage is None:
                raise
            raise CheckpointError(
                f"saving {path} failed: {storage}. Nothing was lost: {newest_saved(self.dirpath)}. Free space on "
                f"that disk or make {self.dirpath} writable (or point paths.log_dir elsewhere and pass "
                f"ckpt_path=<that checkpoint>), then run the same command to continue"
            ) from error
        self.saved_step, self.last_model_path = step, str(path)
        if trainer.is_global_zero:
            if not sidecar_path(path).is_file():  # the writer verified the bytes it wrote before its sidecar
                raise CheckpointError(
                    f"{path} was saved without a sidecar: the checkpoint was not written by AtomicCheckpointIO "
                    f"(trainer.plugins), or the strategy bypasses it (for sharded checkpoints use FSDP2: "
                    f"trainer=fsdp_cpu trainer.strategy.save_distributed_checkpoint=true)"
                )
            link_last(path)
            self.prune(keep=path)
            for logger in trainer.loggers:  # as ModelCheckpoint does: a logger may keep it (W&B artifacts)
                logger.after_save_checkpoint(self)  # type: ignore[arg-type]  # loggers read last_model_path only

    def prune(self, keep: Path) -> None:
        checkpoints = saved_checkpoints(self.dirpath)
        newest = {path for _, path in checkpoints[: self.keep_last]} | {keep}
        for step, path in checkpoints:
            permanent = self.keep_every is not None and step % self.keep_every == 0
            if path not in newest and not permanent:
                remove(path)
        for leftover in self.dirpath.glob(".*.tmp-*"):  # what a save interrupted by a crash left behind
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink(missing_ok=True)


def storage_fault(error: BaseException) -> OSError | None:
    """The OSError (disk full, permission denied, ...) behind `error`, if any: `torch.save` and DCP wrap
    the one their file writes raised in their own errors."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        if isinstance(seen, dcp.api.CheckpointException):  # DCP collects each rank's error
            return next(filter(None, (storage_fault(failure) for failure, _ in seen.failures.values())), None)
        seen = seen.__cause__ or seen.__context__
    return None


def newest_saved(directory: Path) -> str:
    """Where a run stopped by a failed save continues from, in words."""
    saved = saved_checkpoints(directory)
    return f"the newest complete checkpoint, {saved[0][1]}, is intact" if saved else "no checkpoint was saved before"


def link_last(path: Path) -> None:
    """Point `last.ckpt` at `path`, atomically."""
    temporary = temporary_path(path.with_name(LAST_LINK))
    temporary.symlink_to(path.name)
    os.replace(temporary, path.with_name(LAST_LINK))
