"""Attention parts every backbone shares: rotary positions, document masks and the attention call. In a packed block
a position attends only within its document: on CUDA through FlexAttention's block-sparse kernel (blocks crossing
documents are never computed), elsewhere through a boolean SDPA mask. Rotary positions (RoPE; Llama, ModernBERT) use
GPT-NeoX's and Llama's layout (each head's first half paired with its second), so rotary weights mean the same in
Hugging Face's Llama."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from pretraining.errors import ConfigError
from pretraining.ranges import Range

# What attention may see: None (everything, or causal), a boolean (batch, 1, query, key) mask, True where allowed,
# or FlexAttention's block-sparse form of one.
AttentionMask = torch.Tensor | BlockMask | None
# Rotary cosines and sines, (length, head width / 2) or per row (batch, 1, length, head width / 2); None: no rotary.
Rotary = tuple[torch.Tensor, torch.Tensor] | None
ROTARY_BASE = 10000.0
# Llama 3's RoPE scaling (`model.backbone.rope_scaling`, config.json's rope_scaling): rope_type llama3 and these.
RopeScaling = dict[str, Any]
LLAMA3_SCALING = {
    "factor": Range(gt=0),
    "low_freq_factor": Range(gt=0),
    "high_freq_factor": Range(gt=0),
    "original_max_position_embeddings": Range(ge=1, why="a whole number of positions"),
}
# FlexAttention's kernels need heads of this many dimensions at least.
FLEX_MIN_HEAD_WIDTH = 16


@functools.cache
def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` compiled once (shapes are fixed), on first use: importing the compiler costs seconds of start-up,
    and FlexAttention and its block masks are fast only compiled."""
    return torch.compile(function, dynamic=False)


def head_width(d_model: int, n_head: int) -> int:
    """The dimensions of each attention head, refused unless d_model splits evenly into n_head heads."""
    if d_model % n_head:
        raise ConfigError(
            f"model.backbone.d_model={d_model} must be divisible by model.backbone.n_head={n_head}: change "
            f"either, so that each of the n_head attention heads gets d_model / n_head dimensions"
        )
    return d_model // n_head


def multi_head_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    causal: bool,
    dropout: float = 0.0,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of queries (batch, head, length, width) over keys and values, which may have fewer heads
    (grouped-query attention, never copied). `mask`: see `AttentionMask`; None keeps the fused (causal) kernels.
    `scale`: of the scores (`Parametrization.attention_scale`); None: 1 / sqrt(width)."""
    grouped = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return document_attention(q, k, v, mask, grouped, scale)
    is_causal = causal and mask is None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, enable_gqa=grouped, scale=scale
    )


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask,
    grouped: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """FlexAttention under a block mask, compiled; inside `model.compile`'s graph, traced in instead: a compiled
    function called while another is traced breaks torch.compile's view replay."""
    if torch.compiler.is_compiling():
        return cast(torch.Tensor, flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=grouped))
    return cast(torch.Tensor, compiled(flex_attention)(q, k, v, block_mask=mask, scale=scale, enable_gqa=grouped))


def rotary_angles(
    position_ids: torch.Tensor, head_width: int, base: float = ROTARY_BASE, scaling: RopeScaling | None = None
) -> Rotary:
    """The rotary cosines and sines of `position_ids` (length,) or (batch, length): pair i of a head's
    dimensions turns by position * base^(-2i / head_width), the frequency rescaled as `scaling` says."""
    exponents = torch.arange(0, head_width, 2, device=position_ids.device, dtype=torch.float32) / head_width
    frequencies = base**-exponents
    if scaling is not None:
        frequencies = llama3_frequencies(frequencies, scaling)
    angles = position_ids[..., None].float() * frequencies
    if angles.dim() == 3:
        angles = angles[:, None]  # a head dimension
    return angles.cos(), angles.sin()


def llama3_frequencies(frequencies: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's RoPE scaling, as transformers' `_compute_llama3_parameters` (modeling_rope_utils.py): pairs
    turning slower than once in original_max_position_embeddings / low_freq_factor positions turn `factor` times
    slower still (the long context's new positions look like the old ones), those faster than once in
    original / high_freq_factor keep their frequency, and those between are interpolated smoothly."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, smoothed, scaled)


def checked_rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    """`scaling` (`model.backbone.rope_scaling`) as a plain dict, refused unless it is Llama 3's with each number
    in its range: the only RoPE scaling the backbones compute."""
    if scaling is None:
        return None
    key = "model.backbone.rope_scaling"
    if not isinstance(scaling, Mapping) or scaling.get("rope_type") != "llama3":
        raise ConfigError(
            f"{key}={scaling!r}: the backbones compute Llama 3's RoPE scaling only; set {key}.rope_type=llama3 with "
            f"{', '.join(LLAMA3_SCALING)}, or {key}=null for plain rotary positions"
        )
    unknown = sorted(set(scaling) - {"rope_type", *LLAMA3_SCALING})
    if unknown:
        raise ConfigError(f"{key} has {', '.join(unknown)}, which Llama 3's scaling does not read: remove them")
    checked: RopeScaling = {"rope_type": "llama3"}
    for name, bounds in LLAMA3_SCALING.items():
        value = scaling.get(name)
        whole = name != "original_max_position_embeddings" or isinstance(value, int)
        if not isinstance(value, int | float) or isinstance(value, bool) or not whole or not bounds.admits(value):
            raise ConfigError(f"{key}.{name}={value!r} must be {bounds}: set it as the model's config.json says")
        checked[name] = value
    if checked["high_freq_factor"] <= checked["low_freq_factor"]:
        raise ConfigError(
            f"{key}.high_freq_factor={checked['high_freq_factor']} must exceed low_freq_factor="
            f"{checked['low_freq_factor']}: the frequencies between the two are interpolated"
        )
    return checked


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Queries or keys (batch, head, length, width) rotated, each head's first half paired with its second."""
    cos, sin = (part.to(x.dtype) for part in rotary)  # bfloat16 queries stay bfloat16 under autocast
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def attention_mask(
    attend: torch.Tensor | None, documents: torch.Tensor | None, causal: bool, flex: bool
) -> AttentionMask:
    """What each position may attend to: FlexAttention's block mask for documents on CUDA when `flex` allows (the
    caller knows its dropout and head width), else a boolean mask, or None. Arguments as in `Backbone.forward`."""
    if attend is None:
        if documents is None:
            return None
        if documents.is_cuda and flex:
            return document_block_mask(documents, causal)
    parts = []  # broadcastable to (batch, query, key)
    if attend is not None:
        parts.append(attend[:, None, :])
    if documents is not None:
        parts.append(documents[:, :, None] == documents[:, None, :])
    if causal:
        length = parts[0].shape[-1]
        parts.append(torch.ones(length, length, dtype=torch.bool, device=parts[0].device).tril())
    mask = parts[0]
    for part in parts[1:]:
        mask = mask & part
    return mask.unsqueeze(-3)  # a head dimension: (batch, 1, query, key)


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
