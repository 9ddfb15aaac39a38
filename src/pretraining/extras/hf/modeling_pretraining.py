"""The template's bidirectional backbone as a `transformers` model, written into every masked-LM and
contrastive export (`trust_remote_code=True`), so the export loads where the `pretraining` package is
not installed. It imports only torch and transformers.

Its modules and weight names are the template's own (`pretraining.models.transformer.Transformer`): pre-norm blocks
of `attention` (fused `qkv`, `proj`) and `mlp` (`up`, GELU, `down`), learned or rotary positions
(`positions`), a final LayerNorm, and a masked-LM head tied to the token embedding. Biases and dropout
follow the config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput


class PretrainingConfig(PretrainedConfig):
    model_type = "pretraining-transformer"

    def __init__(
        self,
        vocab_size: int = 320,
        max_seq_len: int = 256,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        bias: bool = False,
        dropout: float = 0.0,
        positions: str = "learned",
        **kwargs,
    ) -> None:
        if positions not in ("learned", "rotary"):
            raise ValueError(f"positions={positions!r} in config.json must be 'learned' or 'rotary'")
        self.vocab_size, self.max_seq_len, self.d_model = vocab_size, max_seq_len, d_model
        self.positions = positions
        self.n_layer, self.n_head, self.bias, self.dropout = n_layer, n_head, bias, dropout
        self.hidden_size = d_model  # the name sentence-transformers and pipelines read
        super().__init__(**kwargs)


def rotary_angles(length: int, head_width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles of positions 0 .. length - 1 (base 10000)."""
    exponents = torch.arange(0, head_width, 2, device=device, dtype=torch.float32) / head_width
    angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * 10000.0**-exponents
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries or keys turned by their positions, the first half of each head's dimensions paired with the second."""
    cos, sin = (part.to(x.dtype) for part in rotary)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config: PretrainingConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rotary: tuple | None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, config: PretrainingConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.down = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: PretrainingConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attention = SelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)
        self.residual_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rotary: tuple | None) -> torch.Tensor:
        x = x + self.residual_dropout(self.attention(self.attention_norm(x), mask, rotary))
        return x + self.mlp(self.mlp_norm(x))


class PretrainingPreTrainedModel(PreTrainedModel):
    config_class = PretrainingConfig
    base_model_prefix = "model"

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


class PretrainingModel(PretrainingPreTrainedModel):
    """Final hidden states (`last_hidden_state`) of token ids; `attention_mask` 0 marks padding."""

    def __init__(self, config: PretrainingConfig) -> None:
        super().__init__(config)
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.position_embedding = nn.Embedding(config.max_seq_len, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.d_model, bias=config.bias)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token_embedding

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> BaseModelOutput:
        length, config = input_ids.shape[1], self.config
        x, rotary = self.token_embedding(input_ids), None
        if config.positions == "learned":
            x = x + self.position_embedding(torch.arange(length, device=input_ids.device))
        else:
            rotary = rotary_angles(length, config.d_model // config.n_head, input_ids.device)
        x = self.dropout(x)
        # (batch, head, query, key): no position attends to padding.
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask, rotary)
        return BaseModelOutput(last_hidden_state=self.final_norm(x))


class PretrainingForMaskedLM(PretrainingPreTrainedModel):
    """Logits over the (padded) vocabulary at every position, from the head tied to the token embedding."""

    def __init__(self, config: PretrainingConfig) -> None:
        super().__init__(config)
        self.model = PretrainingModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.token_embedding

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        hidden = self.model(input_ids, attention_mask).last_hidden_state
        logits = F.linear(hidden, self.model.token_embedding.weight)
        loss = None
        if labels is not None:  # -100 where a position is not scored
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
