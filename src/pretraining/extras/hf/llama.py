"""A causal `Llama` backbone as Hugging Face's Llama-family models, both ways: `LlamaForCausalLM` (Llama 2 and 3,
SmolLM; Llama's `attention_bias`), `Qwen2ForCausalLM` (biases on q, k and v), `Qwen3ForCausalLM` (QK-norm) in and
out, and `MistralForCausalLM` in (a Llama whose sliding window, where it has one, covers every input the run feeds).

The backbone's parameters have Hugging Face's names without the `model.` prefix and compute as Hugging
Face's layers do (tests/extras/hf/test_llama_parity.py, test_stock_models.py), so its weights go out renamed by
that prefix alone, no code of ours beside them. The vocabulary is the backbone's padded one, as the GPT-2 export's,
so the logits agree at every id; a tied head is left out of the weights, as `transformers` expects. What the
backbone cannot compute (sliding windows in use, experts, other RoPE variants, MLP biases, custom code) is refused
naming the config.json key and what it would need.
"""

from __future__ import annotations

from typing import Any

import torch

from pretraining.data.tokenizer import EOS_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.extras.hf.loading import (
    Placement,
    Tensors,
    check_placements,
    head_apart,
    load_placements,
    stored_names,
)
from pretraining.models.llama import ACTIVATIONS, Llama

# (model_type, architecture) by the backbone's (qk_norm, attention_bias): Qwen3 is Llama with an RMSNorm on each
# head's queries and keys (q_norm, k_norm), Qwen2 Llama with biases on q, k and v.
ARCHITECTURES = {
    (False, "none"): ("llama", "LlamaForCausalLM"),
    (False, "all"): ("llama", "LlamaForCausalLM"),
    (False, "qkv"): ("qwen2", "Qwen2ForCausalLM"),
    (True, "none"): ("qwen3", "Qwen3ForCausalLM"),
    (True, "all"): ("qwen3", "Qwen3ForCausalLM"),
}
LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# The attention biases a model type always has (no attention_bias key); the others read attention_bias.
TYPE_BIASES = {"qwen2": "qkv", "mistral": "none"}
# config.json's sizes, by the model.backbone key each is; every writer of these models writes them.
SIZES = {
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "intermediate_size": "mlp_width",
}
# config.json's settings: (the model.backbone key, the default the Llama-family configs take when absent).
SETTINGS: dict[str, tuple[str, Any]] = {
    "hidden_act": ("activation", "silu"),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "rope_theta": ("rope_theta", 10000.0),
    "tie_word_embeddings": ("tie_head", False),
}
# What the backbone always computes, as config keys: (the value it writes, also the default when absent; in words).
FIXED: dict[str, tuple[Any, str]] = {
    "mlp_bias": (False, "no biases in the MLP"),
    "partial_rotary_factor": (1.0, "rotary positions over each head's every dimension"),
}
# Keys of a mixture of experts (Mixtral, Qwen-MoE, DeepSeek): the backbone's MLP is one dense gated MLP a layer.
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
# The config.json key that says each model.backbone key (qk_norm and attention_bias: `said`).
CONFIG_KEY = {
    **{name: key for key, name in SIZES.items()},
    **{name: key for key, (name, _) in SETTINGS.items()},
    "head_dim": "head_dim",
    "rope_scaling": "rope_scaling",
}
ROTARY = "plain rotary positions or Llama 3's RoPE scaling (rope_type llama3)"
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DEFAULT_WINDOW = 4096  # Mistral's, Qwen2's and Qwen3's sliding_window when config.json leaves it out


def backbone_settings(backbone: Llama) -> dict[str, Any]:
    """The model.backbone keys that config.json holds, with the backbone's values."""
    return {
        "d_model": backbone.d_model,
        "n_layer": len(backbone.layers),
        "n_head": backbone.n_head,
        "n_kv_head": backbone.n_kv_head,
        "mlp_width": backbone.mlp_width,
        "head_dim": backbone.head_width,
        "activation": backbone.activation,
        "norm_eps": backbone.norm_eps,
        "rope_theta": backbone.rope_theta,
        "rope_scaling": backbone.rope_scaling,
        "tie_head": backbone.lm_head is None,
        "attention_bias": backbone.attention_bias,
        "qk_norm": backbone.qk_norm,
    }


def llama_config(backbone: Llama) -> dict[str, Any]:
    """config.json of the causal backbone as `LlamaForCausalLM` (`Qwen3ForCausalLM` with QK-norm,
    `Qwen2ForCausalLM` with biases on q, k and v alone)."""
    architecture = ARCHITECTURES.get((backbone.qk_norm, backbone.attention_bias))
    if architecture is None:
        raise ConfigError(
            "model.backbone.qk_norm=true with attention_bias=qkv has no architecture in transformers (Qwen3 has "
            "QK-norm and all four biases or none, Qwen2 q/k/v biases without QK-norm): it cannot be exported"
        )
    ours = backbone_settings(backbone)
    return {
        "architectures": [architecture[1]],
        "model_type": architecture[0],
        "vocab_size": backbone.embed_tokens.num_embeddings,  # padded: the logits of every id match
        **{key: ours[name] for key, name in SIZES.items()},
        "head_dim": backbone.head_width,
        **{key: ours[name] for key, (name, _) in SETTINGS.items()},
        "attention_bias": backbone.attention_bias == "all",
        "mlp_bias": False,
        "rope_scaling": backbone.rope_scaling,
        "use_sliding_window": False,
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


def load_llama(tensors: Tensors, backbone: Llama, source: str) -> None:
    """Load Llama-family weights (with or without the `model.` prefix) into `backbone` tensor by tensor
    (`pretraining.extras.hf.loading`), refusing first a missing, misshapen or non-float tensor and a head apart
    from the embedding where the backbone ties them. The vocabulary tables keep the backbone's own rows past the
    file's (padding: ids no tokenizer produces)."""
    names, state = stored_names(tensors, "model."), backbone.state_dict()
    plan = [Placement(name, hf_name(name), table=name in TABLES) for name in state]
    check_placements(tensors, names, state, plan, backbone.vocab_size, source)
    if backbone.lm_head is None and head_apart(tensors, names, "model.embed_tokens.weight"):
        raise ConfigError(
            f"{source} has a head apart from its token embedding, and model.backbone.tie_head=true ties them: "
            "pass model.backbone.tie_head=false"
        )
    load_placements(tensors, names, state, plan, source)


TABLES = ("embed_tokens.weight", "lm_head.weight")  # vocabulary rows: padded in the backbone


def check_llama_fits(config: dict[str, Any], backbone: Llama, vocab_size: int, source: str) -> None:
    """Refuse a Llama-family config.json whose model `backbone` cannot hold exactly, naming what differs and
    the fix. `max_position_embeddings` is not compared: rotary positions keep no table, so the run may train at
    another length (within a sliding window, where the model has one)."""
    if not backbone.causal:
        raise ConfigError(
            f"{source} is {config.get('model_type')}, a causal model: start a causal objective from it "
            "(experiment=clm_tiny model/backbone=llama)"
        )
    check_computable(config, backbone.max_seq_len, source)
    config = with_size_defaults(config)
    absent = [key for key in [*SIZES, "head_dim"] if key not in config]
    if absent:
        raise ConfigError(f"{source} has no {', '.join(absent)} in its config.json: it does not say the model's size")
    ours, found = backbone_settings(backbone), read_settings(config)
    differ = [name for name in ours if found[name] != ours[name]]
    if differ:
        named = ", ".join(f"{said(config, found, name)} (model.backbone.{name}={ours[name]!r})" for name in differ)
        fix = " ".join(f"model.backbone.{name}={as_override(found[name])}" for name in differ)
        raise ConfigError(f"{source} has {named}: pass {fix}")
    vocabulary = config.get("vocab_size")
    if not isinstance(vocabulary, int) or vocabulary < vocab_size:
        raise ConfigError(
            f"{source} has vocab_size={vocabulary!r}, not the {vocab_size} ids of the run's tokenizer at least: "
            "use the tokenizer it was trained with"
        )


def said(config: dict[str, Any], found: dict[str, Any], name: str) -> str:
    """`key=value` of config.json that says model.backbone's `name` (`found` as `read_settings` read it)."""
    if name == "qk_norm" or (name == "attention_bias" and config["model_type"] in TYPE_BIASES):
        return f"model_type={config['model_type']!r}"
    if name == "attention_bias":
        return f"attention_bias={config.get('attention_bias', False)!r}"
    return f"{CONFIG_KEY[name]}={found[name]!r}"


def check_computable(config: dict[str, Any], max_seq_len: int, source: str) -> None:
    """Refuse a model the backbone cannot compute at any size, naming the config.json key and what it needs."""
    cannot = f"{source} has {{}}, and the backbone computes {{}}: it cannot continue this model exactly"
    if "auto_map" in config:
        raise ConfigError(
            cannot.format("auto_map (its own modelling code)", "stock architectures only")
            + "; nothing in a model directory runs code"
        )
    experts = [key for key in EXPERTS if config.get(key)]
    if experts:
        raise ConfigError(
            cannot.format(f"{experts[0]}={config[experts[0]]!r}", "one dense MLP a layer, no mixture of experts")
            + "; it would need a routed MoE layer"
        )
    for key, (computed, meaning) in FIXED.items():
        value = config.get(key, rope_parameters(config).get(key, computed))
        if value != computed:
            raise ConfigError(cannot.format(f"{key}={value!r}", meaning))
    activation = config.get("hidden_act", "silu")
    if activation not in ACTIVATIONS:
        raise ConfigError(cannot.format(f"hidden_act={activation!r}", f"a gate of {' or '.join(ACTIVATIONS)}"))
    window = sliding_window(config)
    if window is not None and window < max_seq_len:
        raise ConfigError(
            f"{source} has sliding_window={window} (each position attends to the last {window} only), and the "
            f"backbone attends over its whole input, up to model.backbone.max_seq_len={max_seq_len}: pass "
            f"model.backbone.max_seq_len={window} or less (a window covering every input is full attention), or "
            "start from a model without one; longer inputs would need sliding-window attention"
        )
    parameters, key = rope_parameters(config), "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    kind = rope_type(parameters)
    if kind not in ("default", "llama3"):
        raise ConfigError(cannot.format(f"{key}.rope_type={kind!r}", ROTARY) + f"; {kind} would need its frequencies")
    missing = [name for name in LLAMA3_KEYS if llama3_scaling(config).get(name) is None]
    if kind == "llama3" and missing:
        raise ConfigError(
            f"{source} has {key}={config[key]!r}, and the backbone computes Llama 3's scaling from "
            f"{', '.join(LLAMA3_KEYS)}: it lacks {', '.join(missing)}; restore its config.json"
        )


def sliding_window(config: dict[str, Any]) -> int | None:
    """The window attention slides over as transformers reads config.json (Mistral: `sliding_window` unless null;
    Qwen2 and Qwen3: with `use_sliding_window`, or a layer of `layer_types` that slides), or None: none."""
    sliding = "sliding_attention" in (config.get("layer_types") or [])
    if config.get("model_type") == "mistral" or config.get("use_sliding_window") or sliding:
        window = config.get("sliding_window", DEFAULT_WINDOW)
        return window if isinstance(window, int) else None
    return None


def with_size_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with the sizes transformers derives where a config.json leaves them out (those of Llama 2's
    time): as many key/value heads as query heads, and heads of hidden_size / num_attention_heads (Qwen3: 128)."""
    if "num_attention_heads" not in config:
        return config
    heads = config["num_attention_heads"]
    derived = {"num_key_value_heads": heads}
    if config.get("model_type") == "qwen3":
        derived["head_dim"] = 128
    elif isinstance(config.get("hidden_size"), int) and isinstance(heads, int) and heads > 0:
        derived["head_dim"] = config["hidden_size"] // heads
    return {**derived, **{key: value for key, value in config.items() if value is not None}}


def read_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The model.backbone keys' values that a config.json says (a setting absent: transformers' default)."""
    found = {name: config[key] for key, name in SIZES.items()}
    found["head_dim"] = config["head_dim"]
    found.update({name: config.get(key, default) for key, (name, default) in SETTINGS.items()})
    found["rope_theta"] = rope_parameters(config).get("rope_theta", found["rope_theta"])
    found["rope_scaling"] = rope_scaling(config)
    found["qk_norm"] = config.get("model_type") == "qwen3"
    found["attention_bias"] = TYPE_BIASES.get(config["model_type"], "all" if config.get("attention_bias") else "none")
    return found


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters` ({rope_theta, rope_type, and a scaling's numbers}) where earlier
    versions wrote `rope_theta` and `rope_scaling`, as the export does; transformers 5 reads `rope_scaling` first."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters")
    return parameters if isinstance(parameters, dict) else {}


def rope_type(parameters: dict[str, Any]) -> str:
    """The RoPE variant `rope_parameters` names (older configs: `type`)."""
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def llama3_scaling(config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3's scaling numbers in config.json, the original length taken from max_position_embeddings where
    the scaling leaves it out, as transformers does."""
    parameters = {"original_max_position_embeddings": config.get("max_position_embeddings"), **rope_parameters(config)}
    return {"rope_type": "llama3", **{key: parameters.get(key) for key in LLAMA3_KEYS}}


def rope_scaling(config: dict[str, Any]) -> dict[str, Any] | None:
    """model.backbone.rope_scaling as config.json says it (checked by `check_computable`): None for plain rotary
    positions, else Llama 3's."""
    return llama3_scaling(config) if rope_type(rope_parameters(config)) == "llama3" else None


def as_override(value: Any) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{as_override(item)}" for key, item in value.items()) + "}"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)
