"""Hugging Face model directories: written whole or not at all, and read without running code.

An export is written into a hidden staging directory beside its destination, every file fsynced, then
renamed into place: a crash leaves no half-written model where a reader would take it for whole. Weights
are read from `model.safetensors` (or its index of several files), which holds only tensors, or from a
`pytorch_model.bin` loaded weights-only, one tensor at a time (`StoredTensors`); they are written as one
`model.safetensors`, or past `MAX_SHARD_BYTES` as shards with their index, as `save_pretrained` writes them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pretraining.checkpoint import load_weights_only
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.files import fsync_directory, temporary_path

CONFIG, LINEAGE = "config.json", "lineage.json"  # lineage.json: what `pretrain-export` writes beside the model
SAFETENSORS, SAFETENSORS_INDEX, PICKLED = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
# safetensors' dtype names (the header's), as torch's.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# A file's content, or a function that writes it at the path given (weights: streamed, never all in memory twice).
Content = bytes | Callable[[Path], None]


def check_destination(out: Path) -> None:
    """Refuse, before any work, a destination that holds something or cannot become a directory (an export
    never mixes with other files), and the current directory (it would be replaced under the shell)."""
    if Path(os.path.abspath(out)) == Path.cwd():
        raise ConfigError(f"{out} is the current directory: name a new directory for the export")
    if out.is_symlink():  # the export would replace the link, not fill the directory it points to
        raise ConfigError(
            f"{out} is a symbolic link (to {os.readlink(out)}): name a new directory for the export, or the empty "
            "directory the link points to"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory: choose a new directory, or remove it")
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{out} cannot be created: {parent} is not a writable directory; choose another place")


def write_directory(out: Path, files: Mapping[str, Content]) -> None:
    """Write `files` (relative path: content) as the directory `out`, atomically: a failure or a kill
    leaves no `out` (a kill may leave its hidden staging directory, `.<name>.tmp-*`, beside it)."""
    check_destination(out)
    out = Path(os.path.abspath(out))  # "out/.." and the like: the directory they name
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_path(out)
    umask = os.umask(0)
    os.umask(umask)
    try:
        for name, content in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                content(path)
            path.chmod(0o666 & ~umask)  # as the other files are (safetensors writes 0600 whatever the umask)
            with path.open("rb+") as file:
                os.fsync(file.fileno())
        for directory in {(staging / name).parent for name in files}:
            fsync_directory(directory)
        if out.exists():
            out.rmdir()  # empty, checked above; a directory is renamed only onto nothing
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_directory(out.parent)


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a model directory."""
    path = directory / CONFIG
    if not path.is_file():
        raise MissingFileError(
            f"{path} not found: {directory} is not a Hugging Face model directory (one `pretrain-export` wrote, "
            "or a `save_pretrained` directory)"
        )
    return read_json(path)


def weight_files(directory: Path) -> list[Path]:
    """The files holding a model directory's weights, in the order `transformers` prefers them."""
    if (directory / SAFETENSORS).is_file():
        return [directory / SAFETENSORS]
    if (directory / SAFETENSORS_INDEX).is_file():
        return indexed_files(directory, read_json(directory / SAFETENSORS_INDEX).get("weight_map"))
    if (directory / PICKLED).is_file():
        return [directory / PICKLED]
    raise MissingFileError(
        f"{directory} has no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLED}: it holds no weights to start from"
    )


def indexed_files(directory: Path, weight_map: Any) -> list[Path]:
    """The files a safetensors index names: plain names of files beside it (never a path elsewhere)."""
    index = directory / SAFETENSORS_INDEX
    names = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            raise ConfigError(
                f"{index} names {name!r}, which is not a file beside it (or has no weight_map): restore the directory"
            )
    return [directory / name for name in sorted(set(map(str, names)))]


class StoredTensors(Mapping[str, torch.Tensor]):
    """The tensors of a model directory's weight `files` (`weight_files`) by name, each read from its file only
    when asked for (`tensors[name]`), on the CPU: a loader holds one at a time. `layout` says a tensor's shape and
    dtype from the file's header, without reading it. A safetensors file is opened for each tensor read and closed
    after it, so none of its pages stays mapped (resident) beside the model; a `pytorch_model.bin` is loaded
    weights-only, memory-mapped. Nothing in the files can run code."""

    def __init__(self, files: list[Path]) -> None:
        self.headers: dict[str, tuple[Path, tuple[int, ...], torch.dtype | None]] = {}
        self.pickled: dict[str, torch.Tensor] = {}
        for path in files:
            with damage_named(path):
                if path.name == PICKLED:
                    self.pickled.update(state_dict_of(path))
                    continue
                with safe_open(path, framework="pt", device="cpu") as file:
                    for name in file.keys():  # noqa: SIM118 (a safetensors file is no mapping)
                        header = file.get_slice(name)
                        layout = tuple(header.get_shape()), SAFETENSORS_DTYPES.get(header.get_dtype())
                        self.headers[name] = (path, *layout)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.pickled:
            return self.pickled[name]
        path = self.headers[name][0]
        with damage_named(path), safe_open(path, framework="pt", device="cpu") as file:
            return cast(torch.Tensor, file.get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        yield from self.pickled
        yield from self.headers

    def __len__(self) -> int:
        return len(self.pickled) + len(self.headers)

    def layout(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        """The shape and dtype of tensor `name` (None: a dtype torch has no name for), read from the header."""
        if name in self.pickled:
            return tuple(self.pickled[name].shape), self.pickled[name].dtype
        _, shape, dtype = self.headers[name]
        return shape, dtype


def state_dict_of(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a `pytorch_model.bin`, loaded weights-only: memory-mapped (read as they are used) where
    the file has torch's zip format, read whole where it is older (torch before 1.6 wrote no zip; no map)."""
    loaded = load_weights_only(path, mmap=zipfile.is_zipfile(path))
    if not isinstance(loaded, dict) or not all(isinstance(value, torch.Tensor) for value in loaded.values()):
        raise ConfigError(f"{path} holds no state dict; use a model directory written by save_pretrained")
    return loaded


@contextmanager
def damage_named(path: Path) -> Iterator[None]:
    """Turn a failure to read `path` into a ConfigError naming it; code in a pickle is refused in its own words."""
    try:
        yield
    except (CheckpointError, ConfigError):
        raise
    except Exception as error:  # safetensors and torch.load have no common error type for damage
        raise ConfigError(
            f"{path} cannot be read ({type(error).__name__}: {error}): it is damaged; restore it"
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file of a model directory, refused with the file's name if it is not one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); restore the file") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds no JSON object; restore the file")
    return value


def weights_file(tensors: dict[str, torch.Tensor]) -> Content:
    """A weights file, written straight into the export (never held as bytes beside the tensors)."""
    return lambda path: save_file(tensors, path, metadata={"format": "pt"})  # "pt": what transformers expects


# The most bytes of weights in one file: past them, shards and their index, as `save_pretrained` writes them.
MAX_SHARD_BYTES = 5 * 2**30


def sharded_weights(tensors: dict[str, torch.Tensor]) -> dict[str, Content]:
    """`model.safetensors`, or for a model past `MAX_SHARD_BYTES` the files `model-00001-of-0000N.safetensors`
    and `model.safetensors.index.json` naming each tensor's (tensors in their order, a file filled before the
    next)."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and filled + size > MAX_SHARD_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    if len(groups) == 1:
        return {SAFETENSORS: weights_file(tensors)}
    files = [f"model-{number:05d}-of-{len(groups):05d}.safetensors" for number in range(1, len(groups) + 1)]
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: file for file, group in zip(files, groups, strict=True) for name in group},
    }
    shards = {
        file: weights_file({name: tensors[name] for name in group}) for file, group in zip(files, groups, strict=True)
    }
    return {**shards, SAFETENSORS_INDEX: as_json(index)}


def as_json(value: Any) -> bytes:
    """Strict JSON, which has no NaN or infinity (Python's `json` would write them, other readers refuse them):
    a non-finite number is refused, naming its key."""
    found = non_finite(value)
    if found:
        key, number = found
        raise ConfigError(
            f"the export's {key} is {number}, a number JSON cannot hold: the checkpoint stores a value no model "
            "trains with; export a checkpoint whose settings and validation are finite"
        )
    return (json.dumps(value, indent=2, allow_nan=False, default=str) + "\n").encode()


def non_finite(value: Any, key: str = "") -> tuple[str, float] | None:
    """The first (dotted key, number) in `value` that is a float NaN or infinity, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for name, item in items:
        found = non_finite(item, f"{key}.{name}" if key else str(name))
        if found:
            return found
    return None
