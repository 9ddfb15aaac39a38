"""A `Llama`'s sizes, checked and counted before it is built (pretraining.models.llama)."""

from __future__ import annotations

import math

from pretraining.errors import ConfigError
from pretraining.models.attention import head_width
from pretraining.models.backbone import padded_vocabulary


def default_mlp_width(d_model: int) -> int:
    """8/3 d_model rounded up to a multiple of 64: a gated MLP's three matrices then weigh about GPT-2's two at
    4 d_model (Shazeer 2020; Llama)."""
    return math.ceil(8 * d_model / 3 / 64) * 64


def parameter_count(
    vocab_size: int,
    d_model: int,
    n_layer: int,
    n_head: int,
    n_kv_head: int,
    mlp_width: int,
    qk_norm: bool,
    tie_head: bool,
    head_dim: int | None = None,
    attention_bias: str = "none",
    pad_vocabulary: bool = True,
) -> int:
    """The parameters of a `Llama` of these sizes, counted without building it."""
    width = head_dim or d_model // n_head  # of a head
    attention = 2 * d_model * n_head * width + 2 * d_model * n_kv_head * width + 2 * width * qk_norm
    attention += (n_head + 2 * n_kv_head) * width * (attention_bias != "none") + d_model * (attention_bias == "all")
    layer = attention + 3 * d_model * mlp_width + 2 * d_model  # and the two norms
    table = padded_vocabulary(vocab_size, pad_vocabulary) * d_model
    return table * (1 if tie_head else 2) + n_layer * layer + d_model


def check_shape(
    d_model: int, n_head: int, n_kv_head: int, head_dim: int | None, names: dict[str, tuple[str, tuple[str, ...]]]
) -> int:
    """The width of a head, once sizes and names (key: (value, choices)) that build no model are refused, naming
    the key and the fix."""
    width = head_dim or head_width(d_model, n_head)
    if width % 2:
        heads = (
            (f"head_dim={head_dim}", "an even head_dim")
            if head_dim
            else (f"d_model={d_model} / n_head={n_head}", "d_model and n_head with an even head width")
        )
        raise ConfigError(
            f"rotary positions turn pairs of each head's dimensions, and model.backbone.{heads[0]} is odd: choose "
            f"{heads[1]}"
        )
    if n_head % n_kv_head:
        raise ConfigError(
            f"model.backbone.n_head={n_head} must be divisible by model.backbone.n_kv_head={n_kv_head}: each "
            "key/value head serves n_head / n_kv_head query heads; choose a divisor of n_head (n_head itself: "
            "plain multi-head attention)"
        )
    for key, (value, choices) in names.items():
        if value not in choices:
            raise ConfigError(f"model.backbone.{key}={value!r} must be one of {', '.join(choices)}")
    return width
