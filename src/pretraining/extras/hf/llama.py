"""A causal `Llama` backbone as Hugging Face's own `LlamaForCausalLM`, or `Qwen3ForCausalLM` with QK-norm
(the stock architecture with exactly that layer more), both ways.

The backbone's parameters have Hugging Face's names without the `model.` prefix and compute as Hugging
Face's layers do (tests/extras/hf/test_llama_parity.py), so its weights go out renamed by that prefix alone,
no code of ours beside them. The vocabulary is the backbone's padded one, as the GPT-2 export's, so the
logits agree at every id; a tied head is left out of the weights, as `transformers` expects.
"""

from __future__ import annotations

from typing import Any

import torch

from pretraining.data.tokenizer import EOS_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.extras.hf.weights import check_tensor
from pretraining.models.llama import Llama

# (model_type, architecture) by the backbone's qk_norm: Qwen3 is Llama with an RMSNorm on each head's
# queries and keys, named q_norm and k_norm as the backbone names them.
ARCHITECTURES = {False: ("llama", "LlamaForCausalLM"), True: ("qwen3", "Qwen3ForCausalLM")}
LLAMA_TYPES = tuple(model_type for model_type, _ in ARCHITECTURES.values())
# config.json's sizes, by the model.backbone key each is; every writer of these models writes them.
SIZES = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "intermediate_size": "mlp_width",
}
# config.json's settings: (the model.backbone key, the default LlamaConfig and Qwen3Config both take when absent).
SETTINGS: dict[str, tuple[str, Any]] = {
    "hidden_act": ("activation", "silu"),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "rope_theta": ("rope_theta", 10000.0),
    "tie_word_embeddings": ("tie_head", False),
}
ROTARY = "plain rotary positions (no RoPE scaling)"
# What the backbone always computes, as config keys: (the value it writes, also the default when absent; in words).
FIXED: dict[str, tuple[Any, str]] = {
    "attention_bias": (False, "no biases in attention"),
    "mlp_bias": (False, "no biases in the MLP"),
    "rope_scaling": (None, ROTARY),
    "use_sliding_window": (False, "attention over the whole input (no sliding window)"),
}
# The config.json key that says each model.backbone key (qk_norm: Qwen3 has it, Llama not).
CONFIG_KEY = {
    **{name: key for key, name in SIZES.items()},
    **{name: key for key, (name, _) in SETTINGS.items()},
    "qk_norm": "model_type",
}
TABLES = ("embed_tokens.weight", "lm_head.weight")  # vocabulary rows: padded in the backbone


def backbone_settings(backbone: Llama) -> dict[str, Any]:
    """The model.backbone keys that config.json holds, with the backbone's values."""
    return {
        "d_model": backbone.d_model,
        "n_layer": len(backbone.layers),
        "n_head": backbone.n_head,
        "n_kv_head": backbone.n_kv_head,
        "mlp_width": backbone.mlp_width,
        "activation": backbone.activation,
        "norm_eps": backbone.norm_eps,
        "rope_theta": backbone.rope_theta,
        "tie_head": backbone.lm_head is None,
        "qk_norm": backbone.qk_norm,
    }


def llama_config(backbone: Llama) -> dict[str, Any]:
    """config.json of the causal backbone as `LlamaForCausalLM` (`Qwen3ForCausalLM` with QK-norm)."""
    model_type, architecture = ARCHITECTURES[backbone.qk_norm]
    ours = backbone_settings(backbone)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": backbone.embed_tokens.num_embeddings,  # padded: the logits of every id match
        **{key: ours[name] for key, name in SIZES.items()},
        "head_dim": backbone.head_width,
        **{key: ours[name] for key, (name, _) in SETTINGS.items()},
        **{key: value for key, (value, _) in FIXED.items()},
        "max_position_embeddings": backbone.max_seq_len,
        "attention_dropout": backbone.dropout.p,  # Hugging Face's Llama drops nothing else
        "initializer_range": 0.02,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "use_cache": True,
    }


def hf_name(ours: str) -> str:
    """Hugging Face's name of a backbone parameter: `model.` before all but the head's."""
    return ours if ours.startswith("lm_head.") else f"model.{ours}"


def to_llama(backbone: Llama) -> dict[str, torch.Tensor]:
    """The backbone's weights under Hugging Face's names (float32, contiguous); a tied head has none."""
    return {hf_name(name): tensor.float().contiguous() for name, tensor in backbone.state_dict().items()}


def from_llama(weights: dict[str, Any], backbone: Llama, source: str) -> dict[str, torch.Tensor]:
    """A state dict for `backbone` from Llama weights (with or without the `model.` prefix), refusing a
    missing, misshapen, non-float or non-finite tensor, and a head apart from the embedding where the
    backbone ties them. The vocabulary tables keep the backbone's own rows past the file's (padding: ids no
    tokenizer produces)."""
    weights = {name.removeprefix("model."): value for name, value in weights.items()}
    loaded = {}
    for name, own in backbone.state_dict().items():
        tensor = weights.get(name)
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{source} has no tensor {hf_name(name)}: it is not a complete model of its config.json")
        table = name in TABLES
        check_tensor(tensor, tuple(own.shape), backbone.vocab_size if table else None, f"{source} has {hf_name(name)}")
        loaded[name] = with_own_padding(own, tensor) if table else tensor.to(own.dtype)
    head = weights.get("lm_head.weight")  # transformers leaves a tied head out; a stored one must be the same
    tied = isinstance(head, torch.Tensor) and torch.equal(head, weights["embed_tokens.weight"])
    if backbone.lm_head is None and head is not None and not tied:
        raise ConfigError(
            f"{source} has a head apart from its token embedding, and model.backbone.tie_head=true ties them: "
            "pass model.backbone.tie_head=false"
        )
    return loaded


def with_own_padding(own: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s rows where `own` has them, then `own`'s."""
    table = own.clone()
    rows = min(len(own), len(tensor))
    table[:rows] = tensor[:rows]
    return table


def check_llama_fits(config: dict[str, Any], backbone: Llama, vocab_size: int, source: str) -> None:
    """Refuse a Llama (or Qwen3) config.json whose model `backbone` cannot hold exactly, naming what differs
    and the fix. `max_position_embeddings` is not compared: rotary positions keep no table, so the run may
    train at another length."""
    if not backbone.causal:
        raise ConfigError(
            f"{source} is {config.get('model_type')}, a causal model: start a causal objective from it "
            "(experiment=clm_tiny model/backbone=llama)"
        )
    config = with_size_defaults(config)
    absent = [key for key in [*SIZES, "head_dim"] if key not in config]
    if absent:
        raise ConfigError(f"{source} has no {', '.join(absent)} in its config.json: it does not say the model's size")
    ours, found = backbone_settings(backbone), read_settings(config)
    differ = [name for name in ours if found[name] != ours[name]]
    if differ:
        shown = {**found, "qk_norm": config.get("model_type")}
        named = ", ".join(
            f"{CONFIG_KEY[name]}={shown[name]!r} (model.backbone.{name}={ours[name]!r})" for name in differ
        )
        fix = " ".join(f"model.backbone.{name}={as_override(found[name])}" for name in differ)
        raise ConfigError(f"{source} has {named}: pass {fix}")
    if config["head_dim"] != backbone.head_width:
        raise ConfigError(
            f"{source} has head_dim={config['head_dim']!r}, and the backbone's heads are d_model / n_head = "
            f"{backbone.head_width} wide: it cannot hold this model"
        )
    fixed = {key: config.get(key, computed) for key, (computed, _) in FIXED.items()}
    fixed["rope_parameters.rope_type"] = rope_parameters(config).get("rope_type", "default")
    for key, (computed, meaning) in {**FIXED, "rope_parameters.rope_type": ("default", ROTARY)}.items():
        if fixed[key] != computed:
            raise ConfigError(
                f"{source} has {key}={fixed[key]!r}, and the backbone computes {meaning}: it cannot continue this "
                "model exactly; start from a directory `pretrain-export` wrote"
            )
    vocabulary = config.get("vocab_size")
    if not isinstance(vocabulary, int) or vocabulary < vocab_size:
        raise ConfigError(
            f"{source} has vocab_size={vocabulary!r}, not the {vocab_size} ids of the run's tokenizer at least: "
            "use the tokenizer it was trained with"
        )


def with_size_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the sizes transformers derives where a config.json leaves them out (those of Llama 2's
    time): as many key/value heads as query heads, and heads of hidden_size / num_attention_heads."""
    if "num_attention_heads" not in config:
        return config
    heads = config["num_attention_heads"]
    derived = {"num_key_value_heads": heads}
    if isinstance(config.get("hidden_size"), int) and isinstance(heads, int) and heads > 0:
        derived["head_dim"] = config["hidden_size"] // heads
    return {**derived, **config}


def read_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The model.backbone keys' values that a config.json says (a setting absent: transformers' default)."""
    found = {name: config[key] for key, name in SIZES.items()}
    found.update({name: config.get(key, default) for key, (name, default) in SETTINGS.items()})
    found["rope_theta"] = rope_parameters(config).get("rope_theta", found["rope_theta"])
    found["qk_norm"] = config.get("model_type") == "qwen3"
    return found


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters` ({rope_theta, rope_type}) where earlier versions wrote
    `rope_theta` (and `rope_scaling`), as the export does: both versions read either."""
    parameters = config.get("rope_parameters")
    return parameters if isinstance(parameters, dict) else {}


def as_override(value: Any) -> str:
    """A value as a Hydra override writes it."""
    return str(value).lower() if isinstance(value, bool) else str(value)
