"""The backbone contract: all that objectives, strategies and callbacks may ask of `model.backbone`.

A backbone maps token ids to hidden states and scores hidden states with a language-model head. The
rest of the template reaches it only through the members below, so a new architecture is one module
that subclasses `Backbone` and one config (`configs/model/backbone/`):

- `forward(tokens, attend, documents, position_ids)`: hidden states (batch, length, `d_model`);
- `logits(hidden)`: the language-model head, the one every loss, validation, generation and distillation
  applies to hidden states (a linear projection by `head_weight` unless overridden: a soft cap, a scale);
- `head_weight`: the weight of the head's projection (the FLOPs count and the Hugging Face export read it);
- `vocab_size`, `max_seq_len`, `d_model`, `causal`: the sizes and the kind the objectives check;
- `repeated_layers()`: the repeated units that FSDP2 shards one by one, `model.compile` compiles and activation
  checkpointing recomputes; `run_layers` runs them, checkpointed when a strategy asks;
- `flops_per_token` and `head_flops_per_token`: the model FLOPs behind `perf/mfu`;
- `init_weights()` (a second contrastive tower draws its own) and `describe()` (the run's model line).
"""

from __future__ import annotations

import abc
import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretraining.errors import ConfigError


class Backbone(nn.Module, metaclass=abc.ABCMeta):
    """Token ids in, hidden states out; a head (`logits`) for the language-model objectives. Subclasses set
    `vocab_size`, `max_seq_len`, `d_model` and `causal` in `__init__` and implement the abstract methods."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    causal: bool  # True: a position sees only those before it (next-token); False: all (masked-LM, encoders)
    # Set by the FSDP policy (pretraining.plugins.fsdp): keep only each layer's input for backward and
    # recompute the rest, trading a second forward for activation memory.
    checkpoint_activations: bool = False

    @abc.abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        attend: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, length, d_model) for token ids (batch, length).

        `attend` (batch, length) is False at padding: no position attends to it. `documents` (batch,
        length), each token's document in a packed block (non-decreasing along a row): a position attends
        only within its document. `position_ids` (batch, length) replace 0, 1, ... (`document_positions`
        restarts them per document)."""

    @property
    @abc.abstractmethod
    def head_weight(self) -> torch.Tensor:
        """The weight (vocabulary rows, d_model) of the head's projection, `hidden @ head_weight.T` (see `logits`).
        Its rows may exceed `vocab_size` (padding for faster matmuls); the padded ids never occur in data."""

    @abc.abstractmethod
    def repeated_layers(self) -> Sequence[nn.Module]:
        """The repeated units, in order: each one FSDP2 unit, one compiled module, one checkpointed region.
        Not named `layers`: Hugging Face's decoders keep theirs in a submodule of that name (`layers.0.mlp`),
        which a backbone named as theirs (`Llama`) must be free to have."""

    @abc.abstractmethod
    def init_weights(self) -> None:
        """Draw fresh weights, as at construction."""

    def checked_positions(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """The positions of `tokens` (batch, length): `position_ids` if given, else 0, 1, ...; a sequence longer
        than `max_seq_len` is refused."""
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.backbone.max_seq_len={self.max_seq_len}")
        return torch.arange(length, device=tokens.device) if position_ids is None else position_ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The language-model head: logits (..., padded vocabulary) of hidden states (..., d_model).

        The one head: training losses, validation, generation and distillation all score through it. The
        chunked losses call it on a few positions at a time, so it must score each position alone. Override
        it for another head (a soft cap, a scale) that starts from this projection: `head_weight` stays its
        weight, which the FLOPs count reads; the Hugging Face export writes only this default head."""
        return F.linear(hidden, self.head_weight)

    def run_layers(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """`x` through every layer (each called as `layer(x, *args)`), each recomputed in backward when
        `checkpoint_activations` is set."""
        for layer in self.repeated_layers():
            if self.checkpoint_activations and torch.is_grad_enabled():
                # Non-reentrant: works under FSDP hooks and torch.compile, and replays the same dropout masks.
                x = checkpoint(layer, x, *args, use_reentrant=False)
            else:
                x = layer(x, *args)
        return x

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) of the layers for one token of a `seq_len`-token sequence.

        PaLM's count (appendix B): 6 per weight of every matmul (2 forward, 4 backward), here the layers'
        linear layers; plus attention's two matmuls against the sequence, 12 d_model seq_len a layer
        (queries of d_model dimensions in all heads), counted over the whole sequence even when causal, as
        PaLM does. Left out: embedding lookups, norms, biases, softmax (not matmuls), and the recomputation
        of activation checkpointing (MFU counts the model's FLOPs, not the hardware's). The head is apart:
        `head_flops_per_token`, for each token it scores. Override where attention is wider or narrower."""
        return 6 * self.layer_matmul_weights + 12 * len(self.repeated_layers()) * self.d_model * seq_len

    @functools.cached_property
    def layer_matmul_weights(self) -> int:
        """The weights of the layers' linear layers, counted once: their count is fixed, and asked for at every
        step (the throughput count)."""
        layers = self.repeated_layers()
        return sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))

    def head_flops_per_token(self) -> int:
        """Training FLOPs of the head for one scored token (padded vocabulary)."""
        return 6 * self.head_weight.numel()

    def describe(self) -> str:
        """Its shape in a few words, for the run's model line."""
        count = len(self.repeated_layers())
        return (
            f"{count} layer{'' if count == 1 else 's'} of width {self.d_model}, vocabulary {self.vocab_size}, "
            f"{self.max_seq_len} positions"
        )


def backbones(module: nn.Module) -> list[Backbone]:
    """Every backbone inside `module`: an objective's, a second contrastive tower, a distillation's teacher."""
    return [m for m in module.modules() if isinstance(m, Backbone)]


def padded_vocabulary(vocab_size: int) -> int:
    """The rows of an embedding table or head: a multiple of 64, for faster matmuls."""
    return math.ceil(vocab_size / 64) * 64


def check_fits_in_memory(parameters: int, fix: str) -> None:
    """Refuse a model whose float32 weights alone exceed this machine's memory, before allocating them: the
    allocation would fail (or swap the machine to a halt) only after the data is read. `fix` says which
    sizes to lower."""
    needed, memory = 4 * parameters, physical_memory()
    if memory and needed > memory:
        raise ConfigError(
            f"model.backbone makes {parameters:,} parameters, {needed / 2**30:,.1f} GiB in float32, and this machine "
            f"has {memory / 2**30:,.1f} GiB of memory: {fix}"
        )


def physical_memory() -> int | None:
    """This machine's memory in bytes; None where the OS does not say (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
