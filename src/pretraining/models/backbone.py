"""The backbone contract: all that objectives, strategies and callbacks may ask of `model.backbone`, so a new
architecture is one `Backbone` subclass and one config (`configs/model/backbone/`):

- `forward(tokens, attend, documents, position_ids)`: hidden states (batch, length, `d_model`);
- `logits(hidden)`: the one language-model head (a projection by `head_weight` unless overridden);
- `head_weight`: the head's projection weight (read by the FLOPs count and the Hugging Face export);
- `vocab_size`, `max_seq_len`, `d_model`, `causal`: the sizes and the kind the objectives check;
- `repeated_layers()`: the units FSDP2 shards, `model.compile` compiles and `run_layers` checkpoints;
- `flops_per_token` and `head_flops_per_token`: the model FLOPs behind `perf/mfu`;
- `init_weights()` (a second contrastive tower draws its own) and `describe()` (the run's model line);
- `parametrization`: how it scales with width and depth (`pretraining.models.parametrization`).
"""

from __future__ import annotations

import abc
import functools
import math
import os
from collections.abc import Sequence
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretraining.errors import ConfigError
from pretraining.models.parametrization import STANDARD, Parametrization, scaled
from pretraining.ranges import Range

# `max_seq_len` of every backbone: positions are turned into rotary angles in float32, exact up to 2^24.
SequenceLength = Annotated[int, Range(ge=1, le=2**24, why="positions are exact in float32 up to 2^24")]


class Backbone(nn.Module, metaclass=abc.ABCMeta):
    """Token ids in, hidden states out, and a head (`logits`). Subclasses set `vocab_size`, `max_seq_len`, `d_model`
    and `causal` in `__init__` and implement the abstract methods."""

    vocab_size: int
    max_seq_len: int
    d_model: int
    causal: bool  # True: a position sees only those before it (next-token); False: all (masked-LM, encoders)
    # Set by the FSDP policy (pretraining.plugins.fsdp): recompute each layer in backward to save activation memory.
    checkpoint_activations: bool = False
    parametrization: Parametrization = STANDARD

    @abc.abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        attend: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, length, d_model) for token ids (batch, length). `attend` is False at padding, which
        no position attends to; `documents` (non-decreasing along a row) keeps attention within each packed document;
        `position_ids` replace 0, 1, ... (`document_positions` restarts them per document)."""

    @property
    @abc.abstractmethod
    def head_weight(self) -> torch.Tensor:
        """The head's projection weight (vocabulary rows, d_model; see `logits`). Rows beyond `vocab_size` are
        padding for faster matmuls; those ids never occur in data."""

    @abc.abstractmethod
    def repeated_layers(self) -> Sequence[nn.Module]:
        """The repeated units in order: each one FSDP2 unit, compiled module and checkpointed region. Not `layers`:
        a backbone named as Hugging Face's (`Llama`) needs that name for its submodule (`layers.0.mlp`)."""

    @abc.abstractmethod
    def init_weights(self) -> None:
        """Draw fresh weights, as at construction."""

    def checked_positions(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """`position_ids`, else 0, 1, ...; a sequence longer than `max_seq_len` is refused."""
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.backbone.max_seq_len={self.max_seq_len}")
        return torch.arange(length, device=tokens.device) if position_ids is None else position_ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The language-model head: logits (..., padded vocabulary) of hidden states (..., d_model), through which
        losses, validation, generation and distillation all score. Chunked losses call it a few positions at a time,
        so it must score each alone. An override (a soft cap, a scale) keeps `head_weight` as its projection, which
        the FLOPs count reads; the Hugging Face export writes only this default head. Its input is multiplied by
        the parametrization's output multiplier (1 under `standard`)."""
        return F.linear(scaled(hidden, self.parametrization.output_multiplier), self.head_weight)

    def run_layers(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        """`x` through every layer (`layer(x, *args)`), recomputed in backward if `checkpoint_activations`."""
        for layer in self.repeated_layers():
            if self.checkpoint_activations and torch.is_grad_enabled():
                # Non-reentrant: works under FSDP hooks and torch.compile, and replays the same dropout masks.
                x = checkpoint(layer, x, *args, use_reentrant=False)
            else:
                x = layer(x, *args)
        return x

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) of the layers per token of a `seq_len`-token sequence, by PaLM's
        count (appendix B): 6 per linear weight, plus attention's two matmuls, 12 d_model seq_len a layer over the
        whole sequence even when causal. Left out: embeddings, norms, biases, softmax, and activation
        checkpointing's recomputation (MFU counts the model's FLOPs). The head: `head_flops_per_token`. Override
        where attention is wider or narrower."""
        return 6 * self.layer_matmul_weights + 12 * len(self.repeated_layers()) * self.d_model * seq_len

    @functools.cached_property
    def layer_matmul_weights(self) -> int:
        """The layers' linear weights, counted once: fixed, and asked for at every step."""
        layers = self.repeated_layers()
        return sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))

    def head_flops_per_token(self) -> int:
        """Training FLOPs of the head for one scored token (padded vocabulary)."""
        return 6 * self.head_weight.numel()

    def describe(self) -> str:
        """Its shape in a few words, for the run's model line."""
        count = len(self.repeated_layers())
        rules = self.parametrization
        scaling = "" if rules.name == "standard" else f", {rules.describe()}"
        return (
            f"{count} layer{'' if count == 1 else 's'} of width {self.d_model}, vocabulary {self.vocab_size}, "
            f"{self.max_seq_len} positions{scaling}"
        )


def backbones(module: nn.Module) -> list[Backbone]:
    """Every backbone inside `module`: an objective's, a second contrastive tower (not a distillation's teacher,
    which is kept outside the module's tree)."""
    return [m for m in module.modules() if isinstance(m, Backbone)]


def padded_vocabulary(vocab_size: int, pad: bool = True) -> int:
    """The rows of an embedding table or head: a multiple of 64, for faster matmuls; exactly `vocab_size` unless
    `pad` (`model.backbone.pad_vocabulary=false`: a model directory's table, GPT-2's 50257 rows, whose padding
    rows would join the softmax untrained)."""
    return math.ceil(vocab_size / 64) * 64 if pad else vocab_size


def check_fits_in_memory(parameters: int, fix: str) -> None:
    """Refuse a model whose float32 weights alone exceed this machine's memory before allocating them, which would
    fail (or swap) only after the data is read; `fix` names the sizes to lower."""
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
