"""The backbone's weights and settings in Hugging Face's layouts, both ways.

A causal backbone is GPT-2 (`GPT2LMHeadModel`): the same pre-norm blocks, learned positions, exact GELU
(`activation_function: gelu`) or GPT-2's own tanh one (`gelu_new`, the backbone's `activation=gelu_tanh`), and a
tied head. GPT-2's `Conv1D` stores each matrix transposed, its biases and LayerNorm shifts always exist (zeros
where the backbone has none), and an export's vocabulary is the backbone's padded one, so its logits equal the
template's at every id; a stock GPT-2 (50257 ids, its biases, `gelu_new`) loads into `bias=true
activation=gelu_tanh pad_vocabulary=false` (`callbacks.init_from_hf` refuses a table of other rows than the file's:
`init_from.check_same_table`). A bidirectional backbone keeps
its own names, read by the modelling code written beside it (`modeling_pretraining.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from pretraining.data.tokenizer import EOS_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.extras.hf.loading import (
    Placement,
    Tensors,
    check_finite,
    check_layout,
    check_placements,
    head_apart,
    layout,
    load_placements,
    stored_names,
)
from pretraining.models.backbone import Backbone
from pretraining.models.parametrization import KEY
from pretraining.models.transformer import Transformer

# What the backbone computes, as GPT-2 config keys: (the value it writes, GPT2Config's default, in words).
# A config read back is checked against these with GPT-2's defaults for absent keys, as transformers reads it.
GPT2_COMPUTES: dict[str, tuple[Any, Any, str]] = {
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
# model.backbone.activation by GPT-2's activation_function (absent: GPT2Config's gelu_new); the first of each is
# what an export writes. gelu_pytorch_tanh is torch's kernel for the same formula.
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
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
        "activation_function": next(key for key, ours in GPT2_ACTIVATIONS.items() if ours == backbone.activation),
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


def load_gpt2(tensors: Tensors, backbone: Transformer, source: str) -> None:
    """Load GPT-2 weights (with or without the `transformer.` prefix) into `backbone` tensor by tensor
    (`pretraining.extras.hf.loading`), refusing first a missing, misshapen or non-float tensor, non-zero biases it
    has no place for and a head not tied to the embedding. The embedding keeps `backbone`'s own rows past GPT-2's
    (padding: ids no tokenizer produces)."""
    names, state = stored_names(tensors, "transformer."), backbone.state_dict()
    plan, placeless = [], {}
    for ours, theirs, transposed in gpt2_names(backbone.n_layer):
        if ours in state:
            plan.append(Placement(ours, theirs, transposed, table=ours == "token_embedding.weight"))
        else:  # a bias the backbone does not have: checked as one of its weight's rows, then for zeros
            placeless[theirs] = tuple(state[ours.replace(".bias", ".weight")].shape[:1])
    check_placements(tensors, names, state, plan, backbone.vocab_size, source)
    for theirs, rows in placeless.items():
        if theirs not in names:
            raise ConfigError(f"{source} has no tensor {theirs}: it is not a complete GPT-2 model")
        check_layout(*layout(tensors, names[theirs]), rows, None, f"{source} has {theirs}")
    for theirs in placeless:
        bias = tensors[names[theirs]]
        check_finite(bias, f"{source} has {theirs}")
        if bias.count_nonzero():
            raise ConfigError(
                f"{source} has non-zero {theirs}, and model.backbone.bias=false has no place for it: "
                "pass model.backbone.bias=true"
            )
    if head_apart(tensors, names, "transformer.wte.weight"):
        raise ConfigError(f"{source} has a head apart from its token embedding; the backbone's head is tied to it")
    load_placements(tensors, names, state, plan, source)


def to_encoder(backbone: Transformer) -> dict[str, torch.Tensor]:
    """The bidirectional backbone's weights under its own names (float32, contiguous), as
    `modeling_pretraining.PretrainingModel` reads them."""
    return {name: tensor.float().contiguous() for name, tensor in backbone.state_dict().items()}


def encoder_config(backbone: Transformer) -> dict[str, Any]:
    """config.json fields of a bidirectional backbone for `modeling_pretraining.PretrainingConfig`, whose MLP
    computes exact GELU only."""
    if backbone.activation != "gelu":
        raise ConfigError(
            f"model.backbone.activation={backbone.activation} has no encoder export (its modelling code computes "
            "exact GELU): train the encoder with model.backbone.activation=gelu to export it"
        )
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
    ours: dict[str, Any] = {
        "d_model": backbone.d_model,
        "n_layer": backbone.n_layer,
        "n_head": backbone.n_head,
        "max_seq_len": backbone.max_seq_len,
    }
    found = {key: config.get(name, default) for key, (name, default) in GPT2_SIZES.items()}
    activation = config.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ConfigError(
            f"{source} has activation_function={activation!r}, and the backbone computes exact GELU (gelu) or its "
            "tanh approximation (gelu_new): it cannot continue this model exactly"
        )
    keys = {key: name for key, (name, _) in GPT2_SIZES.items()} | {"activation": "activation_function"}
    ours["activation"], found["activation"] = backbone.activation, GPT2_ACTIVATIONS[activation]
    shown = {**found, "activation": activation}
    differ = [key for key in keys if found[key] != ours[key]]
    if differ:
        named = ", ".join(f"{keys[key]}={shown[key]!r} (model.backbone.{key}={ours[key]!r})" for key in differ)
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


def check_standard(backbone: Backbone, refusal: str) -> None:
    """The Hugging Face architectures compute standard rules: no multiplier of the scores, branches or head. A
    backbone under others is refused with `refusal` (what it cannot do and the fix)."""
    if backbone.parametrization.name != "standard":
        raise ConfigError(f"this model is under {KEY}={backbone.parametrization.describe()}, {refusal}")
