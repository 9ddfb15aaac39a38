"""Loading a checkpoint's objects without letting the file run code.

`torch.load(weights_only=True)`'s refusal advises `weights_only=False`, the one thing a file from elsewhere
must never get: every load goes through `load_weights_only` (or `refusing_code`), which words it our way."""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pretraining.errors import CheckpointError


def load_weights_only(path: Path, mmap: bool = False) -> Any:
    """The objects of a `torch.save` file, on the CPU, if it holds only tensors and plain data."""
    with refusing_code(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


@contextmanager
def refusing_code(path: Path) -> Iterator[None]:
    """Turn the weights-only unpickler's refusal of `path` into a `CheckpointError` that says what it is."""
    try:
        yield
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL (\S+)", str(error))
        if found is None:  # not a refusal: the bytes are no pickle torch wrote
            raise CheckpointError(
                f"{path} cannot be read as a checkpoint: it is damaged or was not written by torch.save; "
                "use another checkpoint"
            ) from None
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data (it refers to {found[1]}), which could run "
            "code when loaded: it will not be loaded. Use a checkpoint written by `pretrain`; a file of your own "
            "must hold only tensors, numbers, strings, lists and dicts (save a state_dict, not a module or an object)"
        ) from None
