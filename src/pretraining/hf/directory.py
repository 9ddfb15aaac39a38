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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pretraining.checkpoint import load_weights_only
from pretraining.errors import ConfigError, MissingFileError
from pretraining.files import fsync_directory, temporary_path

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX, PICKLED = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"


def check_destination(out: Path) -> None:
    """Refuse, before any work, a destination that holds something (an export never mixes with other files)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty: choose a new directory, or remove it first")


def write_directory(out: Path, files: Mapping[str, bytes]) -> None:
    """Write `files` (relative path: content) as the directory `out`, atomically."""
    check_destination(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_path(out)
    try:
        for name, content in files.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as file:
                file.write(content)
                file.flush()
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
    try:
        config = json.loads(path.read_text())
    except ValueError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); restore the file") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds no JSON object; restore the file")
    return config


def weight_files(directory: Path) -> list[Path]:
    """The files holding a model directory's weights, in the order `transformers` prefers them."""
    if (directory / SAFETENSORS).is_file():
        return [directory / SAFETENSORS]
    if (directory / SAFETENSORS_INDEX).is_file():
        index = json.loads((directory / SAFETENSORS_INDEX).read_text())
        return [directory / name for name in sorted(set(index["weight_map"].values()))]
    if (directory / PICKLED).is_file():
        return [directory / PICKLED]
    raise MissingFileError(
        f"{directory} has no {SAFETENSORS}, {SAFETENSORS_INDEX} or {PICKLED}: it holds no weights to start from"
    )


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory, on the CPU; nothing in the files can run code."""
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        if path.name == PICKLED:
            loaded = load_weights_only(path)
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path} holds no state dict; use a model directory written by save_pretrained")
            weights.update(loaded)
            continue
        try:
            weights.update(load_file(path))
        except (SafetensorError, OSError) as error:
            raise ConfigError(f"{path} cannot be read as safetensors ({error}): it is damaged; restore it") from None
    return weights
