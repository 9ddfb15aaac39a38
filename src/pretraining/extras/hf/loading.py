"""Weights from a model directory into a backbone's parameters, tensor by tensor: peak memory the model plus a
tensor or two (the weights are never gathered into a state dict beside the model).

A family's mapping (`pretraining.extras.hf.llama`, `.weights`) says which stored tensor goes where
(`Placement`). Everything a file's header says is checked first, for every tensor, before any parameter changes:
each tensor is there, has its parameter's shape (a vocabulary table: rows covering the tokenizer's; `init_from`
requires the backbone's exactly) and is a float. Checks that need a tensor's values and would refuse a model,
not a damaged file (a stored head apart from a tied embedding, non-zero biases with no place), read those
tensors before the load as well. Only finiteness is checked as each tensor is read during the load: a file
damaged that way raises mid-way, and the run stops (`InitFrom.setup` fails) with a half-loaded model that
nothing trains.

Under FSDP2 (`pretraining.plugins.fsdp`), Lightning calls callbacks' `setup` before the objective's
`configure_model` shards it and before the strategy moves it to its device: every rank holds the whole model on the
CPU then, reads every tensor of the directory once into it, and FSDP2 keeps its shard. Per rank the peak is the
model plus a tensor or two, as above; reading only a rank's shards would need the load after sharding, into
DTensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pretraining.errors import ConfigError
from pretraining.extras.hf.directory import StoredTensors

Tensors = Mapping[str, torch.Tensor]  # by name: a `StoredTensors`, or any state dict


@dataclass(frozen=True)
class Placement:
    """Where the stored tensor `theirs` goes: the backbone's state-dict entry `ours`, transposed first where the
    file stores it so (GPT-2's Conv1D); a vocabulary `table` fills the rows both have, the backbone's padding rows
    keeping their own values (ids no tokenizer produces)."""

    ours: str
    theirs: str
    transposed: bool = False
    table: bool = False


def stored_names(tensors: Tensors, prefix: str) -> dict[str, str]:
    """The stored name of each tensor by its full one, `prefix` before all but a head's (`model.`, `transformer.`):
    a base model's file leaves the prefix out."""
    return {name if name.startswith((prefix, "lm_head.")) else f"{prefix}{name}": name for name in tensors}


def layout(tensors: Tensors, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """A tensor's shape and dtype, from a file's header where it is one (nothing read)."""
    if isinstance(tensors, StoredTensors):
        return tensors.layout(name)
    return tuple(tensors[name].shape), tensors[name].dtype


def check_layout(
    shape: tuple[int, ...], dtype: torch.dtype | None, expected: tuple[int, ...], vocab_size: int | None, found: str
) -> None:
    """Refuse a tensor of another shape than `expected`, or not a float; a vocabulary table (`vocab_size` given:
    the token embedding, an untied head) may have any number of rows that covers the tokenizer's `vocab_size`."""
    rows_fit = len(shape) == len(expected) and (
        shape[0] >= vocab_size if vocab_size is not None else shape[0] == expected[0]
    )
    if not rows_fit or shape[1:] != expected[1:]:
        wanted = f"(at least {vocab_size}, {expected[1]})" if vocab_size is not None else str(expected)
        raise ConfigError(f"{found} of shape {shape}, not {wanted}: it does not fit its config.json")
    if dtype is None or not dtype.is_floating_point:
        raise ConfigError(f"{found} with {dtype or 'a dtype torch cannot read'}: it holds no usable weights")


def check_finite(tensor: torch.Tensor, found: str) -> None:
    if not torch.isfinite(tensor).all():
        raise ConfigError(f"{found} with non-finite values: it holds no usable weights; restore the file")


def check_placements(
    tensors: Tensors,
    names: dict[str, str],
    state: dict[str, torch.Tensor],
    plan: list[Placement],
    vocab_size: int,
    source: str,
) -> None:
    """Refuse, from the headers alone, a `plan` whose tensors are missing, misshapen or not floats."""
    for placement in plan:
        stored = names.get(placement.theirs)
        if stored is None:
            raise ConfigError(
                f"{source} has no tensor {placement.theirs}: it is not a complete model of its config.json"
            )
        expected = tuple(state[placement.ours].shape)
        shape, dtype = layout(tensors, stored)
        expected = expected[::-1] if placement.transposed else expected
        rows = vocab_size if placement.table else None
        check_layout(shape, dtype, expected, rows, f"{source} has {placement.theirs}")


def load_placements(
    tensors: Tensors, names: dict[str, str], state: dict[str, torch.Tensor], plan: list[Placement], source: str
) -> None:
    """Copy each tensor of a checked `plan` into its parameter, one read at a time (cast to the parameter's dtype
    in the copy), refusing a non-finite one."""
    with torch.no_grad():
        for placement in plan:
            tensor = tensors[names[placement.theirs]]
            check_finite(tensor, f"{source} has {placement.theirs}")
            tensor = tensor.T if placement.transposed else tensor
            target = state[placement.ours]
            if placement.table:
                rows = min(len(target), len(tensor))
                target[:rows].copy_(tensor[:rows])
            else:
                target.copy_(tensor)
            del tensor  # the next read reuses its memory


def head_apart(tensors: Tensors, names: dict[str, str], embedding: str) -> bool:
    """Whether a stored `lm_head.weight` differs from the token `embedding` (transformers leaves a tied head out;
    a stored one must be the same to be tied)."""
    if "lm_head.weight" not in names:
        return False
    return not torch.equal(tensors[names["lm_head.weight"]], tensors[names[embedding]])
