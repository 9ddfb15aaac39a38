"""A Llama-style backbone in plain PyTorch (`Backbone`'s second kind), named as Hugging Face's Llama. Against the
GPT-2-style `Transformer`: RMSNorm, rotary positions always (`max_seq_len` only bounds the input), a gated MLP (SwiGLU
with `activation=silu`, squared ReLU with `relu2`), grouped-query attention (`n_kv_head` key/value heads: a smaller
cache at generation), optional QK-norm (Qwen3, OLMo-2: attention logits cannot blow up), a tied or own head
(`tie_head`). For the open models it continues: attention biases (`attention_bias`: Qwen2's on q/k/v, or on all four
projections), heads of their own width (`head_dim`: Qwen3-0.6B's 16 heads of 128 over 1024 dimensions) and Llama 3's
RoPE scaling (`rope_scaling`); the MLP never has biases. `dropout` (none by default) acts as the `Transformer`'s,
for runs that reread their data.

Parameters are named as in `LlamaForCausalLM` without its `model.` prefix, and compute as it does (RMSNorm in
float32, rotary over each head's two halves), so an export renames nothing and reproduces the logits. The embedding's
rows (and an untied head's) are padded to a multiple of 64; an export keeps them and suppresses the padded ids.
`causal=False` serves masked-LM and contrastive encoders; document masking and `position_ids` are as in the
`Transformer` (`pretraining.models.attention`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import nn

from pretraining.models.attention import (
    FLEX_MIN_HEAD_WIDTH,
    AttentionMask,
    RopeScaling,
    attention_mask,
    checked_rope_scaling,
    multi_head_attention,
    rotary_angles,
    rotate,
)
from pretraining.models.backbone import Backbone, SequenceLength, check_fits_in_memory, padded_vocabulary
from pretraining.models.llama_shape import check_shape, default_mlp_width, parameter_count
from pretraining.models.parametrization import checked_parametrization, scaled
from pretraining.ranges import Positive, Range, checked_ranges


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer; modded-nanogpt): Hugging Face's `hidden_act="relu2"`."""
    return F.relu(x).square()


# The gate's activation, by Hugging Face's `hidden_act` name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "relu2": squared_relu}
# How o_proj and down_proj start: `zero` (modded-nanogpt, nanochat) makes each layer the identity, so the residual
# stream keeps its scale at any depth with no std to tune; `scaled`: GPT-2's N(0, 0.02 / sqrt(2 n_layer)).
OUTPUT_INITS = ("zero", "scaled")
# Which attention projections have biases: none (Llama's default), qkv (Qwen2's: q, k, v but not o), all (Llama's
# `attention_bias: true`). One key of three values, not two booleans: no stock model has a bias on o alone.
ATTENTION_BIASES = ("none", "qkv", "all")
INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Scale by the reciprocal root mean square, then a learned weight; in float32, the weight applied after casting
    back, as Hugging Face's `LlamaRMSNorm` (the same logits in bfloat16)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions (Hugging Face's `self_attn`): heads `head_width` wide
    (None: d_model / n_head), biases as `bias` says (`Llama`'s `attention_bias`), scores scaled by `scale` (None:
    1 / sqrt(head_width))."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        qk_norm: bool,
        norm_eps: float,
        dropout: float,
        causal: bool,
        head_width: int | None = None,
        bias: str = "none",
        scale: float | None = None,
    ) -> None:
        super().__init__()
        head_width = head_width or d_model // n_head
        self.n_head, self.n_kv_head, self.head_width, self.causal = n_head, n_kv_head, head_width, causal
        self.dropout, self.scale = dropout, scale
        self.q_proj = nn.Linear(d_model, n_head * head_width, bias=bias != "none")
        self.k_proj = nn.Linear(d_model, n_kv_head * head_width, bias=bias != "none")
        self.v_proj = nn.Linear(d_model, n_kv_head * head_width, bias=bias != "none")
        self.o_proj = nn.Linear(n_head * head_width, d_model, bias=bias == "all")
        self.q_norm = RMSNorm(head_width, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_width, norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, mask: AttentionMask, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.n_head, self.head_width)
        k = self.k_proj(x).view(batch, length, self.n_kv_head, self.head_width)
        v = self.v_proj(x).view(batch, length, self.n_kv_head, self.head_width)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's own vector, before rotary (Qwen3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, head, length, width)
        dropout = self.dropout if self.training else 0.0
        y = multi_head_attention(rotate(q, rotary), rotate(k, rotary), v, mask, self.causal, dropout, self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """The gated MLP: `down_proj(act(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, d_model: int, width: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.up_proj = nn.Linear(d_model, width, bias=False)
        self.down_proj = nn.Linear(width, d_model, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm layer (Hugging Face's `LlamaDecoderLayer`): the backbone's unit (`Backbone.repeated_layers`), each
    branch times `branch_multiplier` (`Parametrization.branch_multiplier`)."""

    def __init__(
        self,
        d_model: int,
        attention: Attention,
        mlp_width: int,
        activation: str,
        norm_eps: float,
        branch_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(d_model, norm_eps)
        self.mlp = MLP(d_model, mlp_width, activation)
        self.dropout = nn.Dropout(attention.dropout)
        self.branch_multiplier = branch_multiplier

    def forward(self, x: torch.Tensor, mask: AttentionMask, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        attended = self.dropout(self.self_attn(self.input_layernorm(x), mask, rotary))
        x = x + scaled(attended, self.branch_multiplier)
        return x + scaled(self.dropout(self.mlp(self.post_attention_layernorm(x))), self.branch_multiplier)


class Llama(Backbone):
    """Token embeddings, `n_layer` pre-norm decoder layers, a final RMSNorm, and a tied or own head.
    `head_dim` null: heads of d_model / n_head dimensions. `rope_scaling`: null (plain rotary positions) or Llama 3's
    ({rope_type: llama3, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}).
    `parametrization` and the base shape (`base_width`, `base_depth`, `base_n_head`):
    `pretraining.models.parametrization` (a `head_dim` of its own keeps the heads' width at every d_model)."""

    @checked_ranges("model.backbone")
    def __init__(
        self,
        vocab_size: Positive,
        max_seq_len: SequenceLength = 256,
        d_model: Positive = 128,
        n_layer: Positive = 4,
        n_head: Positive = 4,
        n_kv_head: Positive | None = None,
        mlp_width: Positive | None = None,
        activation: str = "silu",
        qk_norm: bool = False,
        tie_head: bool = True,
        rope_theta: Annotated[float, Range(gt=0)] = 10000.0,
        rope_scaling: Mapping[str, Any] | None = None,
        head_dim: Positive | None = None,
        attention_bias: str = "none",
        norm_eps: Annotated[float, Range(gt=0, lt=1)] = 1e-5,
        output_init: str = "zero",
        dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0,
        causal: bool = True,
        pad_vocabulary: bool = True,
        parametrization: str = "standard",
        base_width: Positive | None = None,
        base_depth: Positive | None = None,
        base_n_head: Positive | None = None,
    ) -> None:
        super().__init__()
        n_kv_head = n_kv_head or n_head
        mlp_width = mlp_width or default_mlp_width(d_model)
        names = {"activation": (activation, tuple(ACTIVATIONS)), "output_init": (output_init, OUTPUT_INITS)}
        names["attention_bias"] = (attention_bias, ATTENTION_BIASES)
        width = check_shape(d_model, n_head, n_kv_head, head_dim, names)
        parameters = parameter_count(
            vocab_size,
            d_model,
            n_layer,
            n_head,
            n_kv_head,
            mlp_width,
            qk_norm,
            tie_head,
            width,
            attention_bias,
            pad_vocabulary,
        )
        check_fits_in_memory(parameters, "lower model.backbone.d_model, n_layer or mlp_width")
        base = (base_width, base_depth, base_n_head)
        self.parametrization = rules = checked_parametrization(
            parametrization, d_model, n_layer, n_head, base, head_dim
        )
        self.vocab_size, self.max_seq_len, self.d_model, self.causal = vocab_size, max_seq_len, d_model, causal
        self.n_head, self.n_kv_head, self.head_width = n_head, n_kv_head, width
        # The settings an export writes into Hugging Face's config.json.
        self.mlp_width, self.activation, self.qk_norm = mlp_width, activation, qk_norm
        self.rope_theta, self.norm_eps, self.output_init = rope_theta, norm_eps, output_init
        self.rope_scaling: RopeScaling | None = checked_rope_scaling(rope_scaling)
        self.attention_bias = attention_bias
        rows = padded_vocabulary(vocab_size, pad_vocabulary)
        self.embed_tokens = nn.Embedding(rows, d_model)
        self.dropout = nn.Dropout(dropout)
        scale = rules.attention_scale(width)
        self.layers = nn.ModuleList(
            DecoderLayer(
                d_model,
                Attention(d_model, n_head, n_kv_head, qk_norm, norm_eps, dropout, causal, width, attention_bias, scale),
                mlp_width,
                activation,
                norm_eps,
                rules.branch_multiplier,
            )
            for _ in range(n_layer)
        )
        self.norm = RMSNorm(d_model, norm_eps)
        self.lm_head = None if tie_head else nn.Linear(d_model, rows, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Draw fresh weights: N(0, 0.02) (the layers' as the parametrization says), norms at one, the output
        projections as `output_init` says, zero biases."""
        rules = self.parametrization
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Linear | nn.Embedding):
                std = rules.hidden_std(INIT_STD) if name.startswith("layers.") else INIT_STD
                if name.endswith(("o_proj", "down_proj")) and self.output_init == "zero":
                    nn.init.zeros_(module.weight)
                elif name.endswith(("o_proj", "down_proj")):
                    nn.init.normal_(module.weight, std=std / math.sqrt(2 * rules.residual_depth(len(self.layers))))
                else:
                    nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        attend: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, length, d_model): see `Backbone.forward`."""
        position_ids = self.checked_positions(tokens, position_ids)
        rotary = rotary_angles(position_ids, self.head_width, self.rope_theta, self.rope_scaling)
        # FlexAttention has no dropout, and its kernels need heads of 16 dimensions at least.
        flex = not (self.training and self.dropout.p) and self.head_width >= FLEX_MIN_HEAD_WIDTH
        mask = attention_mask(attend, documents, self.causal, flex=flex)
        return self.norm(self.run_layers(self.dropout(self.embed_tokens(tokens)), mask, rotary))

    @property
    def head_weight(self) -> torch.Tensor:
        """The untied head's weight, or the token embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def repeated_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def flops_per_token(self, seq_len: int) -> int:
        """`Backbone.flops_per_token` with attention's two matmuls over the n_head x head_dim dimensions of the
        queries (d_model, unless `head_dim` says otherwise), whatever n_kv_head is; the projections' weights count
        the smaller key/value ones."""
        return 6 * self.layer_matmul_weights + 12 * len(self.layers) * self.n_head * self.head_width * seq_len

    def describe(self) -> str:
        return f"{super().describe()}, {self.n_head} heads, {self.n_kv_head} key/value heads"
