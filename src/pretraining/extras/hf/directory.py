"""Hugging Face model directories: written whole or not at all, and read without running code.

An export is written into a hidden staging directory beside its destination, every file fsynced, then
renamed into place: a crash leaves no half-written model where a reader would take it for whole. Weights
are read from `model.safetensors` (or its index of several files), which holds only tensors, or from a
`pytorch_model.bin` loaded weights-only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from pretraining.checkpoint import load_weights_only
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.files import fsync_directory, temporary_path

CONFIG, LINEAGE = "config.json", "lineage.json"  # lineage.json: what `pretrain-export` writes beside the model
SAFETENSORS, SAFETENSORS_INDEX, PICKLED = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
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


def read_weights(files: list[Path]) -> dict[str, Any]:
    """Every tensor of a model directory's weight `files` (`weight_files`), on the CPU; nothing in the
    files can run code."""
    weights: dict[str, Any] = {}
    for path in files:
        try:
            loaded = load_weights_only(path) if path.name == PICKLED else load_file(path)
        except CheckpointError:  # code in a pickle: refused in its own words
            raise
        except Exception as error:  # safetensors and torch.load have no common error type for damage
            raise ConfigError(
                f"{path} cannot be read ({type(error).__name__}: {error}): it is damaged; restore it"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} holds no state dict; use a model directory written by save_pretrained")
        weights.update(loaded)
    return weights


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file of a model directory, refused with the file's name if it is not one."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); restore the file") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds no JSON object; restore the file")
    return value
