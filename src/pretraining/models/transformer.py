"""GPT-2's pre-norm transformer backbone in plain PyTorch, readable in one sitting (`Backbone`'s first kind).
`causal=True` for next-token prediction, `causal=False` for masked-LM and contrastive encoders; the head is tied to
the token embedding. Document masks and rotary positions are shared (`pretraining.models.attention`). Positions are
learned (GPT-2, BERT) or rotary, whose scores depend on the offset between positions: a bidirectional model learns to
read its neighbours far sooner with them (masked-LM with learned positions predicted the most frequent byte). The
MLP's GELU is exact (erf) or GPT-2's tanh approximation (`activation=gelu_tanh`): with `bias=true` as well, a stock
GPT-2 computes here as in `transformers`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from pretraining.errors import ConfigError
from pretraining.models.attention import (
    FLEX_MIN_HEAD_WIDTH,
    AttentionMask,
    Rotary,
    attention_mask,
    head_width,
    multi_head_attention,
    rotary_angles,
    rotate,
)
from pretraining.models.backbone import Backbone, SequenceLength, check_fits_in_memory, padded_vocabulary
from pretraining.models.parametrization import STANDARD, Parametrization, checked_parametrization, scaled
from pretraining.ranges import Positive, Range, checked_ranges

POSITIONS = ("learned", "rotary")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU by its tanh approximation: GPT-2's, transformers' `gelu_new` (named by what it computes, as torch's
    `approximate="tanh"`, not by when it was new)."""
    return F.gelu(x, approximate="tanh")


# The MLP's activation: exact (erf) GELU, the default, or GPT-2's tanh approximation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "gelu_tanh": gelu_tanh}


class SelfAttention(nn.Module):
    def __init__(
        self, d_model: int, n_head: int, dropout: float, bias: bool, causal: bool, scale: float | None = None
    ) -> None:
        super().__init__()
        head_width(d_model, n_head)
        self.n_head, self.dropout, self.causal, self.scale = n_head, dropout, causal, scale
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor, mask: AttentionMask = None, rotary: Rotary = None) -> torch.Tensor:
        """`mask`: see `AttentionMask`; None keeps the fused (causal) kernels. `rotary`: see `Rotary`."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        y = multi_head_attention(q, k, v, mask, self.causal, self.dropout if self.training else 0.0, self.scale)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float, bias: bool, activation: str) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.down = nn.Linear(4 * d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """A pre-norm transformer layer: the backbone's unit (`Backbone.repeated_layers`), its branches scaled as
    `rules` say."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        dropout: float,
        bias: bool,
        causal: bool,
        activation: str,
        rules: Parametrization = STANDARD,
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model, bias=bias)
        self.attention = SelfAttention(d_model, n_head, dropout, bias, causal, rules.attention_scale(d_model // n_head))
        self.mlp_norm = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, dropout, bias, activation)
        self.residual_dropout = nn.Dropout(dropout)
        self.branch_multiplier = rules.branch_multiplier

    def forward(self, x: torch.Tensor, mask: AttentionMask = None, rotary: Rotary = None) -> torch.Tensor:
        attended = self.residual_dropout(self.attention(self.attention_norm(x), mask, rotary))
        x = x + scaled(attended, self.branch_multiplier)
        return x + scaled(self.mlp(self.mlp_norm(x)), self.branch_multiplier)


def parameter_count(
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layer: int,
    bias: bool,
    positions: str,
    pad_vocabulary: bool = True,
) -> int:
    """The parameters of a `Transformer` of these sizes, counted without building it."""
    block = 12 * d_model**2 + 9 * d_model * bias + 2 * d_model * (1 + bias)  # attention and MLP, their norms
    position_table = max_seq_len * d_model if positions == "learned" else 0
    table = padded_vocabulary(vocab_size, pad_vocabulary) * d_model
    return table + position_table + n_layer * block + d_model * (1 + bias)


class Transformer(Backbone):
    """Token embeddings (plus learned position embeddings, or rotary positions in attention), `n_layer` pre-norm
    blocks, a final norm. The table's rows are padded to a multiple of 64 (unless `pad_vocabulary=false`); those
    ids never occur in data. `parametrization` and the base shape (`base_width`, `base_depth`, `base_n_head`):
    `pretraining.models.parametrization`."""

    @checked_ranges("model.backbone")
    def __init__(
        self,
        vocab_size: Positive,
        max_seq_len: SequenceLength = 256,
        d_model: Positive = 128,
        n_layer: Positive = 4,
        n_head: Positive = 4,
        dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        bias: bool = False,
        causal: bool = True,
        positions: str = "learned",
        activation: str = "gelu",
        pad_vocabulary: bool = True,
        parametrization: str = "standard",
        base_width: Positive | None = None,
        base_depth: Positive | None = None,
        base_n_head: Positive | None = None,
    ) -> None:
        super().__init__()
        for key, value, choices in (("positions", positions, POSITIONS), ("activation", activation, ACTIVATIONS)):
            if value not in choices:
                raise ConfigError(f"model.backbone.{key}={value!r} must be one of {', '.join(choices)}")
        if positions == "rotary" and d_model % n_head == 0 and d_model // n_head % 2:
            raise ConfigError(
                f"rotary positions turn pairs of each head's dimensions, and model.backbone.d_model={d_model} / "
                f"n_head={n_head} is odd: choose an even head width, or model.backbone.positions=learned"
            )
        check_fits_in_memory(
            parameter_count(vocab_size, max_seq_len, d_model, n_layer, bias, positions, pad_vocabulary),
            "lower model.backbone.d_model, n_layer or max_seq_len (with learned positions, a table of max_seq_len x "
            "d_model)",
        )
        head_width(d_model, n_head)
        base = (base_width, base_depth, base_n_head)
        self.parametrization = checked_parametrization(parametrization, d_model, n_layer, n_head, base)
        self.positions, self.activation = positions, activation
        self.vocab_size, self.max_seq_len, self.n_layer, self.causal = vocab_size, max_seq_len, n_layer, causal
        self.attention_dropout = dropout
        self.d_model, self.n_head = d_model, n_head
        self.token_embedding = nn.Embedding(padded_vocabulary(vocab_size, pad_vocabulary), d_model)
        if positions == "learned":
            self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_head, dropout, bias, causal, activation, self.parametrization) for _ in range(n_layer)
        )
        self.final_norm = nn.LayerNorm(d_model, bias=bias)
        self.init_weights()

    def init_weights(self) -> None:
        """Draw fresh weights: N(0, 0.02) (the layers' as the parametrization says), residual projections scaled
        down, zero biases."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                std = self.parametrization.hidden_std(0.02) if name.startswith("blocks.") else 0.02
                if name.endswith(("attention.proj", "mlp.down")):
                    # GPT-2: residual-stream projections scaled down so its variance stays flat in depth
                    # (under completep, the branch multiplier does that, and the base depth is counted here).
                    std /= math.sqrt(2 * self.parametrization.residual_depth(self.n_layer))
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        attend: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, length, d_model): see `Backbone.forward` (packed blocks have no padding)."""
        position_ids = self.checked_positions(tokens, position_ids)
        x = self.token_embedding(tokens)
        rotary = None
        if self.positions == "learned":
            x = x + self.position_embedding(position_ids)
        else:
            rotary = rotary_angles(position_ids, self.d_model // self.n_head)
        x = self.dropout(x)
        x = self.run_layers(x, self.attention_mask(attend, documents), rotary)
        return self.final_norm(x)

    def attention_mask(self, attend: torch.Tensor | None, documents: torch.Tensor | None) -> AttentionMask:
        """`pretraining.models.attention.attention_mask`, with FlexAttention where it works."""
        # FlexAttention has no dropout, and its kernels need heads of 16 dimensions at least.
        flex = not (self.training and self.attention_dropout) and self.d_model // self.n_head >= FLEX_MIN_HEAD_WIDTH
        return attention_mask(attend, documents, self.causal, flex)

    @property
    def head_weight(self) -> torch.Tensor:
        """The head is tied to the token embedding."""
        return self.token_embedding.weight

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def describe(self) -> str:
        return f"{super().describe()}, {self.n_head} heads"
