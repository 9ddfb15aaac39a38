"""The backbone's weights and settings in Hugging Face's layouts, both ways.

A causal backbone is GPT-2 (`GPT2LMHeadModel`): the same pre-norm blocks, learned positions, exact GELU
(`activation_function: gelu`) and tied head. GPT-2's `Conv1D` stores each matrix transposed, its
biases and LayerNorm shifts always exist (zeros where the backbone has none), and its vocabulary is the
backbone's padded one, so its logits equal the template's at every id. A bidirectional backbone keeps
its own names, read by the modelling code written beside it (`modeling_pretraining.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from pretraining.data.tokenizer import EOS_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.models.transformer import Transformer

# What the backbone computes, as GPT-2 config keys: (the value it writes, GPT2Config's default, in words).
# A config read back is checked against these with GPT-2's defaults for absent keys, as transformers reads it.
GPT2_COMPUTES: dict[str, tuple[Any, Any, str]] = {
    "activation_function": ("gelu", "gelu_new", "exact (erf) GELU, as torch's F.gelu, not GPT-2's tanh gelu_new"),
    "layer_norm_epsilon": (1e-5, 1e-5, "LayerNorm eps 1e-5 (torch's default)"),
    "n_inner": (None, None, "an MLP 4 x d_model wide"),
    "scale_attn_weights": (True, True, "attention scaled by 1/sqrt(head width)"),
    "scale_attn_by_inverse_layer_idx": (False, False, "no further scaling by layer"),
    "tie_word_embeddings": (True, True, "a head tied to the token embedding"),
    "add_cross_attention": (False, False, "no cross-attention"),
}
# model.backbone's sizes as GPT-2 config keys, with GPT2Config's defaults (GPT-2 small).
GPT2_SIZES = {
    "d_model": ("n_embd", 768),
    "n_layer": ("n_layer", 12),
    "n_head": ("n_head", 12),
    "max_seq_len": ("n_positions", 1024),
}
GPT2_VOCAB_SIZE = 50257
# (backbone name in a block, GPT-2 name in a layer, whether GPT-2 stores the matrix transposed)
GPT2_BLOCK = [
    ("attention_norm", "ln_1", False),
    ("attention.qkv", "attn.c_attn", True),
    ("attention.proj", "attn.c_proj", True),
    ("mlp_norm", "ln_2", False),
    ("mlp.up", "mlp.c_fc", True),
    ("mlp.down", "mlp.c_proj", True),
]
GPT2_OUTSIDE = [("token_embedding", "wte"), ("position_embedding", "wpe"), ("final_norm", "ln_f")]


def gpt2_config(backbone: Transformer) -> dict[str, Any]:
    """config.json of the backbone as `GPT2LMHeadModel`."""
    check_learned_positions(backbone, "exported as GPT-2")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": backbone.token_embedding.num_embeddings,  # padded: the logits of every id match
        "n_positions": backbone.max_seq_len,
        "n_embd": backbone.d_model,
        "n_layer": backbone.n_layer,
        "n_head": backbone.n_head,
        **{key: written for key, (written, _, _) in GPT2_COMPUTES.items()},
        "resid_pdrop": backbone.dropout.p,
        "embd_pdrop": backbone.dropout.p,
        "attn_pdrop": backbone.dropout.p,
        "initializer_range": 0.02,
        "reorder_and_upcast_attn": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
    }


def gpt2_names(n_layer: int) -> list[tuple[str, str, bool]]:
    """(backbone parameter, GPT-2 parameter, transposed) for every weight and bias of GPT-2."""
    pairs = [(ours, f"transformer.{theirs}", False) for ours, theirs in GPT2_OUTSIDE]
    for layer in range(n_layer):
        pairs += [(f"blocks.{layer}.{ours}", f"transformer.h.{layer}.{theirs}", t) for ours, theirs, t in GPT2_BLOCK]
    named = []
    for ours, theirs, transposed in pairs:
        named.append((f"{ours}.weight", f"{theirs}.weight", transposed))
        if "embedding" not in ours:
            named.append((f"{ours}.bias", f"{theirs}.bias", False))
    return named


def to_gpt2(backbone: Transformer) -> dict[str, torch.Tensor]:
    """The backbone's weights under GPT-2's names (float32, contiguous; the tied head left to `transformers`)."""
    state = backbone.state_dict()
    weights = {}
    for ours, theirs, transposed in gpt2_names(backbone.n_layer):
        if ours in state:
            tensor = state[ours].float()
            weights[theirs] = (tensor.T if transposed else tensor).contiguous()
        else:  # a bias the backbone does not have (bias=false): the zeros it implies
            weights[theirs] = torch.zeros(state[ours.replace(".bias", ".weight")].shape[0])
    return weights


def from_gpt2(weights: dict[str, Any], backbone: Transformer, source: str) -> dict[str, torch.Tensor]:
    """A state dict for `backbone` from GPT-2 weights (with or without the `transformer.` prefix), refusing
    a missing, misshapen, non-float or non-finite tensor, non-zero biases it has no place for and a head
    not tied to the embedding. The embedding keeps `backbone`'s own rows past GPT-2's (padding: ids no
    tokenizer produces)."""
    weights = {
        name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}": value
        for name, value in weights.items()
    }
    state = backbone.state_dict()
    loaded = {}
    for ours, theirs, transposed in gpt2_names(backbone.n_layer):
        tensor = weights.get(theirs)
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{source} has no tensor {theirs}: it is not a complete GPT-2 model")
        vocabulary = backbone.vocab_size if ours == "token_embedding.weight" else None
        check_tensor(tensor, gpt2_shape(ours, transposed, state), vocabulary, f"{source} has {theirs}")
        tensor = tensor.T if transposed else tensor
        if ours in state:
            loaded[ours] = tensor.to(state[ours].dtype)
        elif tensor.count_nonzero():
            raise ConfigError(
                f"{source} has non-zero {theirs}, and model.backbone.bias=false has no place for it: "
                "pass model.backbone.bias=true"
            )
    head = weights.get("lm_head.weight")  # transformers leaves a tied head out; a stored one must be the same
    if head is not None and not (
        isinstance(head, torch.Tensor) and torch.equal(head, weights["transformer.wte.weight"])
    ):
        raise ConfigError(f"{source} has a head apart from its token embedding; the backbone's head is tied to it")
    embedding = state["token_embedding.weight"].clone()
    rows = min(len(embedding), len(loaded["token_embedding.weight"]))
    embedding[:rows] = loaded["token_embedding.weight"][:rows]
    return {**loaded, "token_embedding.weight": embedding}


def gpt2_shape(ours: str, transposed: bool, state: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """The shape GPT-2 stores the backbone's `ours` in (matrices transposed); a bias the backbone lacks has
    its weight's rows."""
    shape = tuple(state[ours].shape if ours in state else state[ours.replace(".bias", ".weight")].shape[:1])
    return shape[::-1] if transposed else shape


def check_tensor(tensor: torch.Tensor, expected: tuple[int, ...], vocab_size: int | None, found: str) -> None:
    """Refuse `tensor` unless it is a finite float tensor of the `expected` shape; a vocabulary table
    (`vocab_size` given: the token embedding, an untied head) may have any number of rows that covers the
    tokenizer's `vocab_size`."""
    shape = tuple(tensor.shape)
    rows_fit = len(shape) == len(expected) and (
        shape[0] >= vocab_size if vocab_size is not None else shape[0] == expected[0]
    )
    if not rows_fit or shape[1:] != expected[1:]:
        wanted = f"(at least {vocab_size}, {expected[1]})" if vocab_size is not None else str(expected)
        raise ConfigError(f"{found} of shape {shape}, not {wanted}: it does not fit its config.json")
    if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
        raise ConfigError(
            f"{found} with {'non-finite values' if tensor.is_floating_point() else tensor.dtype}: "
            "it holds no usable weights; restore the file"
        )


def to_encoder(backbone: Transformer) -> dict[str, torch.Tensor]:
    """The bidirectional backbone's weights under its own names (float32, contiguous), as
    `modeling_pretraining.PretrainingModel` reads them."""
    return {name: tensor.float().contiguous() for name, tensor in backbone.state_dict().items()}


def encoder_config(backbone: Transformer) -> dict[str, Any]:
    """config.json fields of a bidirectional backbone for `modeling_pretraining.PretrainingConfig`."""
    return {
        "model_type": "pretraining-transformer",
        "vocab_size": backbone.token_embedding.num_embeddings,
        "max_seq_len": backbone.max_seq_len,
        "d_model": backbone.d_model,
        "n_layer": backbone.n_layer,
        "n_head": backbone.n_head,
        "positions": backbone.positions,
        "bias": backbone.final_norm.bias is not None,
        "dropout": backbone.dropout.p,
        "pad_token_id": PAD_ID,
    }


def check_learned_positions(backbone: Transformer, what: str) -> None:
    """GPT-2 has learned positions: a backbone with rotary ones has no GPT-2 form."""
    if backbone.positions != "learned":
        raise ConfigError(
            f"GPT-2 has learned positions and this causal model has {backbone.positions} ones, so it cannot be "
            f"{what}: train it with model.backbone.positions=learned"
        )


def check_gpt2_fits(config: dict[str, Any], backbone: Transformer, vocab_size: int, source: str) -> None:
    """Refuse a GPT-2 config.json whose model `backbone` cannot hold exactly, naming what differs and the fix."""
    if not backbone.causal:
        raise ConfigError(f"{source} is GPT-2, a causal model: start a causal objective from it (experiment=clm_tiny)")
    check_learned_positions(backbone, f"started from {source}")
    ours = {
        "d_model": backbone.d_model,
        "n_layer": backbone.n_layer,
        "n_head": backbone.n_head,
        "max_seq_len": backbone.max_seq_len,
    }
    found = {key: config.get(name, default) for key, (name, default) in GPT2_SIZES.items()}
    differ = [key for key in GPT2_SIZES if found[key] != ours[key]]
    if differ:
        named = ", ".join(f"{GPT2_SIZES[key][0]}={found[key]!r} (model.backbone.{key}={ours[key]})" for key in differ)
        fix = " ".join(f"model.backbone.{key}={found[key]}" for key in differ)
        raise ConfigError(f"{source} has {named}: pass {fix}")
    for key, (computed, default, meaning) in GPT2_COMPUTES.items():
        value = config.get(key, default)
        if value != computed and not (key == "n_inner" and value == 4 * backbone.d_model):
            raise ConfigError(
                f"{source} has {key}={value!r}, and the backbone computes {meaning} ({key}={computed!r}): "
                "it cannot continue this model exactly; start from a GPT-2 directory `pretrain-export` wrote"
            )
    vocabulary = config.get("vocab_size", GPT2_VOCAB_SIZE)
    if not isinstance(vocabulary, int) or vocabulary < vocab_size:
        raise ConfigError(
            f"{source} has vocab_size={vocabulary!r}, not the {vocab_size} ids of the run's tokenizer at least: "
            "use the tokenizer it was trained with"
        )
