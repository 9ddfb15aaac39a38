"""Sharded checkpoints (FSDP2 with `save_distributed_checkpoint=true`): a directory of
torch.distributed.checkpoint (DCP) files and Lightning's `meta.pt`, published whole with a sidecar
listing every file, and read back so that nothing in it can run code."""

from __future__ import annotations

import enum
import hashlib
import io
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path, PosixPath, WindowsPath
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from pretraining.checkpoint.sidecar import (
    DCP_METADATA,
    SHARDED_META,
    SIDECAR_FORMAT,
    complete_sharded,
    files_under,
    summary,
)
from pretraining.checkpoint.store import remove, vouch_for
from pretraining.checkpoint.weights_only import load_weights_only, refusing_code
from pretraining.errors import CheckpointError
from pretraining.files import fsync_directory, sha256_of

MODEL_KEY = "state_dict"  # Lightning saves the weights under this key; DCP flattens them to "state_dict.<name>"


def save_sharded(shards: dict[str, Any], meta: dict[str, Any] | None, temporary: Path, path: Path) -> None:
    """Write this rank's `shards` into the directory `temporary` with DCP; on rank zero (which passes `meta`,
    all but the shards), once its DCP save is complete every rank's is: write `meta` and publish the
    directory under `path`. If any of it fails, the directory is removed."""
    temporary.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save(shards, checkpoint_id=temporary)
        if meta is not None:
            torch.save(meta, temporary / SHARDED_META)
            publish_sharded(temporary, path)
    finally:
        if meta is not None and temporary.exists():  # a save that failed (published, it is gone)
            shutil.rmtree(temporary, ignore_errors=True)


def save_sharded_async(
    shards: dict[str, Any], meta: dict[str, Any] | None, temporary: Path, path: Path, group: dist.ProcessGroup
) -> Callable[[], None]:
    """Start writing this rank's `shards` into the directory `temporary` with DCP's `async_save`, over `group`
    (a gloo group of the checkpoint's own: its collectives run in DCP's thread and must not interleave with
    training's). The shards are staged in host memory before it returns. Returns the rest of the save, for a
    writer thread: wait for the write; on rank zero (which passes `meta`, all but the shards), once its
    DCP save is complete every rank's is, so write `meta` and publish the directory under `path`; if any of
    it fails, remove the directory."""
    temporary.mkdir(parents=True, exist_ok=True)
    # Without an async_stager, it stages synchronously and returns the write's Future.
    saved = cast(Future[Any], dcp.async_save(shards, checkpoint_id=temporary, process_group=group))

    def finish() -> None:
        if meta is None:
            saved.result()
            return
        try:
            saved.result()
            torch.save(meta, temporary / SHARDED_META)
            publish_sharded(temporary, path)
        finally:
            if temporary.exists():  # a save that failed (published, it is gone)
                shutil.rmtree(temporary, ignore_errors=True)

    return finish


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
    meta = load_weights_only(directory / SHARDED_META)
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
    complete_sharded(directory)
    tensors = model_tensors(WeightsOnlyReader(directory).read_metadata())
    state = {
        MODEL_KEY: {name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in tensors.items()}
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # one process is the intent
        load_shards(state, directory, no_dist=True)
    return {**load_weights_only(directory / SHARDED_META), **state}


def load_sharded_into(module: nn.Module, optimizers: list[Optimizer], directory: Path, strict: bool) -> dict[str, Any]:
    """Restore the FSDP2 `module` and its `optimizers` from a sharded checkpoint, each rank reading its own
    shards, and return meta.pt's state (the rest of the checkpoint). Lightning's loader does the same but
    unpickles the shard index; here nothing in the checkpoint can run code."""
    complete_sharded(directory)
    WeightsOnlyReader(directory).read_metadata()  # an unsafe index refused in our words, before DCP wraps them
    model_state = {MODEL_KEY: get_model_state_dict(module)}
    load_shards(model_state, directory)
    module.load_state_dict(model_state[MODEL_KEY], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"  # as Lightning saves them
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        load_shards(optimizer_state, directory)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return load_weights_only(directory / SHARDED_META)


def load_shards(state: dict[str, Any], directory: Path, **kwargs: Any) -> None:
    """`dcp.load` of `state` from `directory` with the weights-only reader and planner; a refusal of
    ours, which DCP wraps in its own exception (with every rank's traceback), comes out as raised."""
    try:
        dcp.load(state, storage_reader=WeightsOnlyReader(directory), planner=WeightsOnlyPlanner(directory), **kwargs)
    except CheckpointException as error:
        ours = [failure for failure, _ in error.failures.values() if isinstance(failure, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


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


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that the objects saved beside the tensors (an optimizer's param groups:
    numbers, tuples, strings), which DCP unpickles with `weights_only=False`, are refused unless the
    weights-only unpickler accepts them: then DCP's own load of the same bytes calls nothing else."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with refusing_code(self.directory):
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


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
    # Where Python pickles a path: its public module, or the one that defines it (another on some versions).
    *((module, path.__name__) for path in (PosixPath, WindowsPath) for module in ("pathlib", path.__module__)),
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
