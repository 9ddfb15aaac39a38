"""Stock models of the Llama family and GPT-2, built by `transformers` itself with random weights (norms and
biases included) and saved as `save_pretrained` saves them (one sharded, one a weights-only `pytorch_model.bin`),
load through `checked_loader` and `StoredTensors` into backbones with the options that compute what they compute:
the same logits and next-token loss. What the backbones cannot compute is refused naming config.json's key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf.test_llama_parity import check_hugging_face_computes_the_template, exported, llama
from safetensors.torch import load_file, save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.extras.hf.directory import StoredTensors, weight_files
from pretraining.extras.hf.init_from import check_same_table, checked_loader, initialise_from
from pretraining.models.backbone import Backbone
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM

VOCAB = 384  # a multiple of 64: the backbone's table has the stock model's rows exactly, so every logit is compared
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
OURS = {"vocab_size": VOCAB, "max_seq_len": 64, "d_model": 64, "n_layer": 2, "n_head": 4, "mlp_width": 128}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short: the 16-wide heads' slow pairs are scaled, some smoothed
}
# name: (transformers' model, its config, the backbone's options, how it is saved)
MODELS: dict[str, tuple[type, Any, dict[str, Any], dict[str, Any]]] = {
    "llama3-rope-scaling-sharded": (
        LlamaForCausalLM,
        LlamaConfig(**{**SIZES, "num_key_value_heads": 2}, rope_parameters={"rope_theta": 500000.0, **LLAMA3}),
        {"n_kv_head": 2, "rope_theta": 500000.0, "rope_scaling": LLAMA3, "tie_head": False},
        {"max_shard_size": "100KB"},
    ),
    "llama-attention-bias-pickled": (
        LlamaForCausalLM,
        LlamaConfig(**SIZES, attention_bias=True, tie_word_embeddings=True),
        {"attention_bias": "all"},
        {"safe_serialization": False},
    ),
    "qwen2-qkv-bias": (
        Qwen2ForCausalLM,
        Qwen2Config(**{**SIZES, "num_key_value_heads": 2}, tie_word_embeddings=True, rope_theta=1000000.0),
        {"n_kv_head": 2, "attention_bias": "qkv", "rope_theta": 1000000.0},
        {},
    ),
    "qwen3-head-dim": (
        Qwen3ForCausalLM,
        Qwen3Config(**{**SIZES, "num_key_value_heads": 2}, head_dim=32, tie_word_embeddings=True),
        {"n_kv_head": 2, "head_dim": 32, "qk_norm": True},
        {},
    ),
    "mistral-no-window": (
        MistralForCausalLM,
        MistralConfig(**{**SIZES, "num_key_value_heads": 1}, sliding_window=None),
        {"n_kv_head": 1, "tie_head": False},
        {},
    ),
    "mistral-window-covering-the-input": (
        MistralForCausalLM,
        MistralConfig(**SIZES, sliding_window=64),  # = model.backbone.max_seq_len: no position sees past it
        {"tie_head": False},
        {},
    ),
}


def randomised(model: PreTrainedModel) -> PreTrainedModel:
    """`model` in evaluation mode with every norm and bias random too (left at one or zero, a misplaced one would
    not show)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model.eval()


def saved(model: PreTrainedModel, directory: Path, **how: Any) -> dict[str, Any]:
    """Save `model` in `directory` as `save_pretrained` does; its config.json."""
    model.save_pretrained(directory, **how)
    return json.loads((directory / "config.json").read_text())


def loaded(backbone: Backbone, directory: Path, config: dict[str, Any]) -> Backbone:
    """`backbone` with the directory's weights, through the loader `initialise_from` uses."""
    load = checked_loader(config, backbone, VOCAB, f"callbacks.init_from_hf.path={directory}")  # type: ignore[arg-type]
    load(StoredTensors(weight_files(directory)))
    return backbone.eval()


def check_computes_as(backbone: Backbone, model: PreTrainedModel) -> None:
    """The same logits (1e-5) and next-token loss (1e-4) as transformers' model on a batch, in float32."""
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(ids, labels=ids)
        torch.testing.assert_close(backbone.logits(backbone(ids)), theirs.logits, rtol=0, atol=1e-5)
        loss = CausalLM(backbone, optimizer=torch.optim.AdamW).training_loss({"tokens": ids})
    assert loss.item() == pytest.approx(theirs.loss.item(), abs=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_a_stock_llama_family_model_computes_the_same_in_the_backbone(name: str, tmp_path: Path) -> None:
    architecture, config, options, how = MODELS[name]
    model = randomised(architecture(config))
    stored = saved(model, tmp_path, **how)
    if "max_shard_size" in how:
        assert len(weight_files(tmp_path)) > 1
    check_computes_as(loaded(Llama(**OURS, norm_eps=1e-6, **options), tmp_path, stored), model)


def test_a_stock_gpt2_computes_the_same_with_biases_and_its_tanh_gelu(tmp_path: Path) -> None:
    model = randomised(GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB)))
    stored = saved(model, tmp_path)
    assert stored["activation_function"] == "gelu_new"
    backbone = Transformer(
        vocab_size=VOCAB, max_seq_len=64, d_model=64, n_layer=2, n_head=4, bias=True, activation="gelu_tanh"
    )
    check_computes_as(loaded(backbone, tmp_path, stored), model)


def test_a_stock_gpt2_of_50257_ids_keeps_the_backbones_padding_rows(tmp_path: Path) -> None:
    model = randomised(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16)))
    stored = saved(model, tmp_path)
    backbone = Transformer(
        vocab_size=50257, max_seq_len=16, d_model=16, n_layer=1, n_head=2, bias=True, activation="gelu_tanh"
    )
    padding = backbone.token_embedding.weight[50257:].clone()
    load = checked_loader(stored, backbone, 50257, "gpt2")
    load(StoredTensors(weight_files(tmp_path)))
    assert backbone.token_embedding.weight.shape[0] == 50304
    assert torch.equal(backbone.token_embedding.weight[:50257], model.transformer.wte.weight)
    assert torch.equal(backbone.token_embedding.weight[50257:], padding)
    ids = torch.randint(0, 50257, (1, 16))
    with torch.no_grad():
        logits = backbone.logits(backbone(ids))[..., :50257]
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-5)


def stock_config(kind: str, **edit: Any) -> dict[str, Any]:
    """config.json of a small stock model of `kind` with `edit` (a value None: the key left out)."""
    configs = {
        "llama": LlamaConfig(**SIZES),
        "qwen2": Qwen2Config(**SIZES),
        "qwen3": Qwen3Config(**SIZES, head_dim=32),
        "mistral": MistralConfig(**SIZES),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB),
    }
    config = {**configs[kind].to_dict(), **edit}
    return {key: value for key, value in config.items() if value is not None}


@pytest.mark.parametrize(
    ("kind", "edit", "options", "message"),
    [
        (
            "mistral",
            {},
            {"max_seq_len": 8192},
            r"has sliding_window=4096 .* up to model.backbone.max_seq_len=8192: pass model.backbone.max_seq_len=4096",
        ),
        ("mistral", {"sliding_window": 32}, {}, r"has sliding_window=32 \(each position attends to the last 32 only"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, {"attention_bias": "qkv"}, r"sliding_window=16"),
        ("llama", {"num_local_experts": 8}, {}, r"has num_local_experts=8, and the backbone computes one dense MLP"),
        ("llama", {"num_experts": 4}, {}, r"has num_experts=4, .* it would need a routed MoE layer$"),
        ("llama", {"mlp_bias": True}, {}, r"has mlp_bias=True, and the backbone computes no biases in the MLP"),
        ("llama", {"auto_map": {"AutoModel": "x.Y"}}, {}, r"has auto_map \(its own modelling code\), .* runs code$"),
        (
            "llama",
            {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}},
            {},
            r"has rope_parameters.rope_type='yarn', and the backbone computes plain rotary positions or Llama 3's",
        ),
        ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, {}, r"has rope_scaling.rope_type='dynamic'"),
        ("llama", {"partial_rotary_factor": 0.5}, {}, r"has partial_rotary_factor=0.5, and the backbone computes"),
        (
            "llama",
            {"num_key_value_heads": 2},
            {"n_kv_head": 4},
            r"has num_key_value_heads=2 \(model.backbone.n_kv_head=4\): pass model.backbone.n_kv_head=2$",
        ),
        ("llama", {"attention_bias": True}, {}, r"attention_bias=True \(model.backbone.attention_bias='none'\): pass"),
        (
            "llama",
            {"rope_parameters": {"rope_theta": 10000.0, **LLAMA3}},
            {},
            r"has rope_scaling=\{'rope_type': 'llama3', .*\} \(model.backbone.rope_scaling=None\): pass model.backbone"
            r".rope_scaling=\{rope_type:llama3,factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,original_max_",
        ),
        ("qwen2", {}, {}, r"has model_type='qwen2' \(model.backbone.attention_bias='none'\): pass .*=qkv$"),
        (
            "qwen3",
            {},
            {"qk_norm": True},
            r"has head_dim=32 \(model.backbone.head_dim=16\): pass model.backbone.head_dim=32",
        ),
        ("llama", {"vocab_size": 300}, {}, r"has vocab_size=300, not the 384 ids of the run's tokenizer at least"),
        ("llama", {"hidden_act": "gelu"}, {}, r"has hidden_act='gelu', and the backbone computes a gate of silu or"),
    ],
)
def test_what_the_llama_backbone_cannot_compute_is_refused_naming_the_key(
    kind: str, edit: dict[str, Any], options: dict[str, Any], message: str
) -> None:
    backbone = Llama(**{**OURS, "norm_eps": 1e-6, "tie_head": False, **options})
    with pytest.raises(ConfigError, match=message):
        checked_loader(stock_config(kind, **edit), backbone, VOCAB, "callbacks.init_from_hf.path=model")


@pytest.mark.parametrize(
    ("edit", "options", "message"),
    [
        (
            {},
            {},
            r"has activation_function='gelu_new' \(model.backbone.activation='gelu'\): pass .*activation=gelu_tanh$",
        ),
        ({"activation_function": "relu"}, {}, r"has activation_function='relu', and the backbone computes exact GELU"),
        ({"n_embd": 32}, {"activation": "gelu_tanh"}, r"has n_embd=32 \(model.backbone.d_model=64\): pass model"),
    ],
)
def test_what_the_transformer_cannot_compute_is_refused_naming_the_key(
    edit: dict[str, Any], options: dict[str, Any], message: str
) -> None:
    backbone = Transformer(vocab_size=VOCAB, max_seq_len=64, d_model=64, n_layer=2, n_head=4, bias=True, **options)
    with pytest.raises(ConfigError, match=message):
        checked_loader(stock_config("gpt2", **edit), backbone, VOCAB, "callbacks.init_from_hf.path=model")


def test_a_refused_tensor_leaves_the_backbone_as_it_was_and_a_damaged_one_stops_the_load(tmp_path: Path) -> None:
    architecture, config, options, how = MODELS["llama3-rope-scaling-sharded"]
    stored = saved(randomised(architecture(config)), tmp_path, **how)
    shard = next(path for path in weight_files(tmp_path) if "model.norm.weight" in load_file(path))
    weights = load_file(shard)
    backbone = Llama(**OURS, norm_eps=1e-6, **options)
    before = {name: tensor.clone() for name, tensor in backbone.state_dict().items()}
    save_file({name: tensor for name, tensor in weights.items() if name != "model.norm.weight"}, shard)
    with pytest.raises(ConfigError, match=r"has no tensor model.norm.weight: it is not a complete model"):
        loaded(backbone, tmp_path, stored)
    save_file({**weights, "model.norm.weight": weights["model.norm.weight"][:8].contiguous()}, shard)
    with pytest.raises(ConfigError, match=r"has model.norm.weight of shape \(8,\), not \(64,\)"):
        loaded(backbone, tmp_path, stored)
    save_file({**weights, "model.norm.weight": weights["model.norm.weight"].to(torch.int64)}, shard)
    with pytest.raises(ConfigError, match=r"has model.norm.weight with torch.int64: it holds no usable weights"):
        loaded(backbone, tmp_path, stored)
    assert all(torch.equal(backbone.state_dict()[name], tensor) for name, tensor in before.items())
    save_file({**weights, "model.norm.weight": torch.full_like(weights["model.norm.weight"], float("nan"))}, shard)
    with pytest.raises(ConfigError, match=r"has model.norm.weight with non-finite values: .* restore the file"):
        loaded(backbone, tmp_path, stored)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"cannot be read .* it is damaged; restore it"):
        loaded(backbone, tmp_path, stored)


def test_the_origin_keeps_the_directorys_config(tmp_path: Path) -> None:
    backbone = Llama(vocab_size=260, max_seq_len=64, d_model=64, n_layer=2, n_head=4)
    directory = exported(backbone, tmp_path / "out")  # the template's own export: the byte tokenizer reads it
    origin = initialise_from(
        Llama(vocab_size=260, max_seq_len=64, d_model=64, n_layer=2, n_head=4), str(directory), ByteTokenizer()
    )
    assert origin["config"] == json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize(
    ("settings", "architecture"),
    [
        ({"attention_bias": "qkv", "n_kv_head": 2}, Qwen2ForCausalLM),
        ({"attention_bias": "all", "rope_scaling": LLAMA3, "tie_head": False}, LlamaForCausalLM),
        ({"attention_bias": "all", "qk_norm": True, "head_dim": 32}, Qwen3ForCausalLM),
    ],
    ids=["qwen2", "llama-biases-rope-scaling", "qwen3-biases-head-dim"],
)
def test_the_new_options_export_as_the_architecture_that_computes_them(
    settings: dict[str, Any], architecture: type, tmp_path: Path
) -> None:
    backbone = llama(**settings)
    directory = exported(backbone, tmp_path / "out")
    model = CausalLM(backbone, optimizer=torch.optim.AdamW).eval()
    check_hugging_face_computes_the_template(model, directory, architecture)


def test_a_pytorch_model_bin_in_torchs_old_format_loads(tmp_path: Path) -> None:
    """torch before 1.6 wrote no zip: such a file cannot be memory-mapped, and is read whole instead."""
    architecture, config, options, _ = MODELS["llama-attention-bias-pickled"]
    model = randomised(architecture(config))
    model.config.to_json_file(tmp_path / "config.json")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    stored = json.loads((tmp_path / "config.json").read_text())
    check_computes_as(loaded(Llama(**OURS, norm_eps=1e-6, **options), tmp_path, stored), model)


@pytest.mark.parametrize(
    ("pad_vocabulary", "tokenizer_ids", "message"),
    [
        (
            True,
            260,
            r"has vocab_size=260, and this run's table has 320 rows .*pad_vocabulary=false",
        ),
        (
            False,
            260,
            r"has vocab_size=320, and this run's table has 260 rows .*pad_vocabulary=true",
        ),
        (True, 200, r"has vocab_size=320, .* 256 rows for its tokenizer's 200 ids: use the model's own tokenizer"),
    ],
)
def test_a_table_of_other_rows_than_the_files_is_refused_naming_the_fix(
    pad_vocabulary: bool, tokenizer_ids: int, message: str
) -> None:
    """Rows only the backbone has would join the softmax untrained; rows only the file has would be dropped."""
    rows = 260 if pad_vocabulary and tokenizer_ids == 260 else 320
    backbone = Llama(vocab_size=tokenizer_ids, max_seq_len=64, d_model=64, n_layer=2, pad_vocabulary=pad_vocabulary)
    with pytest.raises(ConfigError, match=message):
        check_same_table({"model_type": "llama", "vocab_size": rows}, backbone, "callbacks.init_from_hf.path=model")
