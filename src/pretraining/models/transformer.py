"""A pre-norm transformer backbone in plain PyTorch, readable in one sitting.

The same module serves every objective: `causal=True` for next-token
prediction, `causal=False` for masked-LM and contrastive encoders. It returns
hidden states; `logits()` applies the language-model head, whose weight is
tied to the token embedding.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretraining.errors import ConfigError
from pretraining.ranges import Positive, Range, checked_ranges


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (batch, 1, length, length) or broadcastable, True where attention is allowed; None for
        no padding, which keeps the fused causal kernels."""
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
        )
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
    """A pre-norm transformer layer; the unit that FSDP shards, `torch.compile` compiles and
    activation checkpointing recomputes."""

    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool, causal: bool) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model, bias=bias)
        self.attention = SelfAttention(d_model, n_head, dropout, bias, causal)
        self.mlp_norm = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, dropout, bias)
        self.residual_dropout = nn.Dropout(dropout)
        # Set by the FSDP policy (pretraining.plugins.fsdp): keep only the block's input for backward and
        # recompute the rest, trading a second forward for activation memory.
        self.checkpoint_activations = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            # Non-reentrant: works under FSDP hooks and torch.compile, and replays the same dropout masks.
            return checkpoint(self.layer, x, mask, use_reentrant=False)
        return self.layer(x, mask)

    def layer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.attention_norm(x), mask))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token + learned position embeddings, `n_layer` pre-norm blocks, a final norm.

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
    ) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len, self.n_layer, self.causal = vocab_size, max_seq_len, n_layer, causal
        self.d_model, self.n_head = d_model, n_head
        padded_vocab = math.ceil(vocab_size / 64) * 64
        self.token_embedding = nn.Embedding(padded_vocab, d_model)
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

    def forward(self, tokens: torch.Tensor, attend: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (batch, length, d_model) for token ids (batch, length).

        `attend` (batch, length) is False at padding: no position attends to it. Packed blocks
        have no padding and pass None.
        """
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"sequence of {length} tokens exceeds model.backbone.max_seq_len={self.max_seq_len}")
        positions = torch.arange(length, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        mask = None if attend is None else self._attention_mask(attend)
        for block in self.blocks:
            x = block(x, mask)
        return self.final_norm(x)

    def _attention_mask(self, attend: torch.Tensor) -> torch.Tensor:
        mask = attend[:, None, None, :]  # (batch, head, query, key)
        if self.causal:
            length = attend.shape[1]
            mask = mask & torch.ones(length, length, dtype=torch.bool, device=attend.device).tril()
        return mask

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied language-model head over the padded vocabulary."""
        return F.linear(hidden, self.token_embedding.weight)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) of the blocks for one token of a `seq_len`-token sequence.

        PaLM's count (appendix B): 6 per weight of every matmul (2 forward, 4 backward), here the blocks'
        linear layers (12 d_model^2 per layer); plus attention's two matmuls against the sequence,
        12 n_layer d_model seq_len, counted over the whole sequence even when causal, as PaLM does.
        Left out: embedding lookups, norms, biases, softmax (not matmuls), and the recomputation of
        activation checkpointing (MFU counts the model's FLOPs, not the hardware's). The head is apart:
        `head_flops_per_token`, for each token it scores.
        """
        weights = sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))
        return 6 * weights + 12 * self.n_layer * self.d_model * seq_len

    def head_flops_per_token(self) -> int:
        """Training FLOPs of the tied language-model head for one scored token (padded vocabulary)."""
        return 6 * self.token_embedding.weight.numel()
