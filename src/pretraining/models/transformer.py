"""GPT-2's pre-norm transformer backbone in plain PyTorch, readable in one sitting (`Backbone`'s first kind).

The same module serves every objective: `causal=True` for next-token
prediction, `causal=False` for masked-LM and contrastive encoders. It returns
hidden states; `logits()` applies the language-model head, whose weight is
tied to the token embedding.

Packed blocks hold several documents. Given each token's document (`documents`), a position attends
only within its own document: on CUDA through FlexAttention's block-sparse kernel (whole blocks of the
score matrix that cross documents are never computed), elsewhere through a boolean SDPA mask.

Positions are learned embeddings added to the tokens (GPT-2, BERT), or rotary (RoPE, Su et al. 2021;
Llama, ModernBERT): each head's queries and keys are rotated by angles proportional to their positions,
so attention scores depend on the offset between two positions. A bidirectional model learns to read
its neighbours far sooner with rotary positions: the masked-LM default with learned ones predicted the
most frequent byte at every masked position for its whole run.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Annotated, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretraining.errors import ConfigError
from pretraining.models.backbone import Backbone
from pretraining.ranges import Positive, Range, checked_ranges

# What attention may see: None (everything, or causal), a boolean mask (batch, 1, query, key) that is True
# where attention is allowed, or FlexAttention's block-sparse form of one.
AttentionMask = torch.Tensor | BlockMask | None
# The cosines and sines of the rotary angles (length, head width / 2), or (batch, 1, length, head width / 2)
# for positions that differ by row; None with learned positions.
Rotary = tuple[torch.Tensor, torch.Tensor] | None
POSITIONS = ("learned", "rotary")
ROTARY_BASE = 10000.0


@functools.cache
def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled once for every block and step (shapes are fixed), on first use (importing the
    compiler costs seconds of start-up). FlexAttention and its block masks are fast only compiled."""
    return torch.compile(function, dynamic=False)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """FlexAttention under a block mask, compiled. Inside a compiled block (`model.compile`) the block's graph
    takes it in: a compiled function called while another is traced breaks torch.compile's view replay."""
    if torch.compiler.is_compiling():
        return cast(torch.Tensor, flex_attention(q, k, v, block_mask=mask))
    return cast(torch.Tensor, compiled(flex_attention)(q, k, v, block_mask=mask))


def rotary_angles(position_ids: torch.Tensor, head_width: int) -> Rotary:
    """The rotary cosines and sines of `position_ids` (length,) or (batch, length): pair i of a head's
    dimensions turns by position * ROTARY_BASE^(-2i / head_width)."""
    exponents = torch.arange(0, head_width, 2, device=position_ids.device, dtype=torch.float32) / head_width
    angles = position_ids[..., None].float() * ROTARY_BASE**-exponents
    if angles.dim() == 3:
        angles = angles[:, None]  # a head dimension
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries or keys (batch, head, length, width) rotated: the first half of each head's dimensions
    paired with the second half (GPT-NeoX's and Llama's layout)."""
    cos, sin = (part.to(x.dtype) for part in rotary)  # bfloat16 queries stay bfloat16 under autocast
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool, causal: bool) -> None:
        super().__init__()
        if d_model % n_head:
            raise ConfigError(
                f"model.backbone.d_model={d_model} must be divisible by model.backbone.n_head={n_head}: change "
                f"either, so that each of the n_head attention heads gets d_model / n_head dimensions"
            )
        self.n_head, self.dropout, self.causal = n_head, dropout, causal
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor, mask: AttentionMask = None, rotary: Rotary = None) -> torch.Tensor:
        """`mask`: see `AttentionMask`; None keeps the fused (causal) kernels. `rotary`: see `Rotary`."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        if isinstance(mask, BlockMask):
            y = document_attention(q, k, v, mask)
        else:
            dropout = self.dropout if self.training else 0.0
            is_causal = self.causal and mask is None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.down = nn.Linear(4 * d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """A pre-norm transformer layer: the backbone's unit (`Backbone.layers`)."""

    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool, causal: bool) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model, bias=bias)
        self.attention = SelfAttention(d_model, n_head, dropout, bias, causal)
        self.mlp_norm = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, dropout, bias)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: AttentionMask = None, rotary: Rotary = None) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.attention_norm(x), mask, rotary))
        return x + self.mlp(self.mlp_norm(x))


def padded_vocabulary(vocab_size: int) -> int:
    """The rows of the embedding table: a multiple of 64, for faster matmuls."""
    return math.ceil(vocab_size / 64) * 64


def parameter_count(vocab_size: int, max_seq_len: int, d_model: int, n_layer: int, bias: bool, positions: str) -> int:
    """The parameters of a `Transformer` of these sizes, counted without building it."""
    block = 12 * d_model**2 + 9 * d_model * bias + 2 * d_model * (1 + bias)  # attention and MLP, their norms
    position_table = max_seq_len * d_model if positions == "learned" else 0
    return padded_vocabulary(vocab_size) * d_model + position_table + n_layer * block + d_model * (1 + bias)


def check_fits_in_memory(parameters: int) -> None:
    """Refuse a model whose float32 weights alone exceed this machine's memory, before allocating them: the
    allocation would fail (or swap the machine to a halt) only after the data is read."""
    needed, memory = 4 * parameters, physical_memory()
    if memory and needed > memory:
        raise ConfigError(
            f"model.backbone makes {parameters:,} parameters, {needed / 2**30:,.1f} GiB in float32, and this machine "
            f"has {memory / 2**30:,.1f} GiB of memory: lower model.backbone.d_model, n_layer or max_seq_len (with "
            "learned positions, a table of max_seq_len x d_model)"
        )


def physical_memory() -> int | None:
    """This machine's memory in bytes; None where the OS does not say (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class Transformer(Backbone):
    """Token embeddings (plus learned position embeddings, or rotary positions in attention), `n_layer`
    pre-norm blocks, a final norm.

    The embedding table is padded to a multiple of 64 rows for faster matmuls;
    the padded ids never occur in data, and `logits()` can drop them.
    """

    @checked_ranges("model.backbone")
    def __init__(
        self,
        vocab_size: Positive,
        max_seq_len: Positive = 256,
        d_model: Positive = 128,
        n_layer: Positive = 4,
        n_head: Positive = 4,
        dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        bias: bool = False,
        causal: bool = True,
        positions: str = "learned",
    ) -> None:
        super().__init__()
        if positions not in POSITIONS:
            raise ConfigError(f"model.backbone.positions={positions!r} must be one of {', '.join(POSITIONS)}")
        if positions == "rotary" and d_model % n_head == 0 and d_model // n_head % 2:
            raise ConfigError(
                f"rotary positions turn pairs of each head's dimensions, and model.backbone.d_model={d_model} / "
                f"n_head={n_head} is odd: choose an even head width, or model.backbone.positions=learned"
            )
        check_fits_in_memory(parameter_count(vocab_size, max_seq_len, d_model, n_layer, bias, positions))
        self.positions = positions
        self.vocab_size, self.max_seq_len, self.n_layer, self.causal = vocab_size, max_seq_len, n_layer, causal
        self.attention_dropout = dropout
        self.d_model, self.n_head = d_model, n_head
        self.token_embedding = nn.Embedding(padded_vocabulary(vocab_size), d_model)
        if positions == "learned":
            self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias, causal) for _ in range(n_layer))
        self.final_norm = nn.LayerNorm(d_model, bias=bias)
        self.init_weights()

    def init_weights(self) -> None:
        """Draw fresh weights: N(0, 0.02), residual projections scaled down, zero biases."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                # GPT-2: projections into the residual stream are scaled down so its variance stays flat in depth.
                residual = name.endswith(("attention.proj", "mlp.down"))
                nn.init.normal_(module.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        attend: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, length, d_model): see `Backbone.forward`. Packed blocks have no padding;
        padded pairs are no packed documents."""
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.backbone.max_seq_len={self.max_seq_len}")
        if position_ids is None:
            position_ids = torch.arange(length, device=tokens.device)
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
        """What each position may attend to (`AttentionMask`): FlexAttention's block mask for documents on
        CUDA, where its kernels work, else a boolean mask, or None when nothing is masked."""
        if attend is None:
            if documents is None:
                return None
            # FlexAttention has no dropout, and its kernels need heads of 16 dimensions at least.
            if (
                documents.is_cuda
                and not (self.training and self.attention_dropout)
                and self.d_model // self.n_head >= 16
            ):
                return document_block_mask(documents, self.causal)
        parts = []  # broadcastable to (batch, query, key)
        if attend is not None:
            parts.append(attend[:, None, :])
        if documents is not None:
            parts.append(documents[:, :, None] == documents[:, None, :])
        if self.causal:
            length = parts[0].shape[-1]
            parts.append(torch.ones(length, length, dtype=torch.bool, device=parts[0].device).tril())
        mask = parts[0]
        for part in parts[1:]:
            mask = mask & part
        return mask.unsqueeze(-3)  # a head dimension: (batch, 1, query, key)

    @property
    def head_weight(self) -> torch.Tensor:
        """The head is tied to the token embedding."""
        return self.token_embedding.weight

    def layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def describe(self) -> str:
        return f"{super().describe()}, {self.n_head} heads"


def document_block_mask(documents: torch.Tensor, causal: bool) -> BlockMask:
    """FlexAttention's block-sparse mask: each position sees its own document (causally when `causal`)."""

    def same_document(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        inside = documents[batch, query] == documents[batch, key]
        return inside & (query >= key) if causal else inside

    batch, length = documents.shape
    return compiled(create_block_mask)(same_document, batch, None, length, length, device=documents.device)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 where each document starts in a packed block (batch, length)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts_here = torch.ones_like(documents, dtype=torch.bool)
    starts_here[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts_here, index, 0).cummax(dim=1).values
