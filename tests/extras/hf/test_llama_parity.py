"""The Llama backbone out to Hugging Face and back in. Its weights load by name alone (the `model.` prefix
added) into `LlamaForCausalLM`, or `Qwen3ForCausalLM` with QK-norm, and give the same logits: what the
native export rests on (no renaming, no re-layout of the rotary halves, RMSNorm computed alike). The export
loads in `transformers` with no code of ours and computes what the template computes, from a single-process
checkpoint and from an FSDP2 sharded one; `callbacks.init_from_hf` starts a Llama run from it; every
mismatch is refused before any weights are loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf.test_export import TEXT, compose_run, started_from_export, template
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conftest import tiny_run
from pretraining.data.tokenizer import EOS_ID, ByteTokenizer
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.directory import SAFETENSORS, write_directory
from pretraining.extras.hf.export import export, model_files
from pretraining.extras.hf.init_from import initialise_from
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.train import train
from test_resume import pretrain, run_dir
from test_sharded_checkpoint import SHARDED

SHAPE = {"vocab_size": 260, "max_seq_len": 64, "d_model": 64, "n_layer": 2, "n_head": 4}  # the byte tokenizer's ids
SETTINGS = {
    "llama-grouped": {"n_kv_head": 2},
    "llama-untied-relu2": {"tie_head": False, "activation": "relu2", "rope_theta": 500000.0},
    "qwen3-qk-norm": {"n_kv_head": 1, "qk_norm": True, "norm_eps": 1e-6},
}
ARCHITECTURE = {
    "llama-grouped": LlamaForCausalLM,
    "llama-untied-relu2": LlamaForCausalLM,
    "qwen3-qk-norm": Qwen3ForCausalLM,
}


def llama(**settings: Any) -> Llama:
    """A Llama of `SHAPE` whose every weight is random, norms included (theirs must be applied where HF does)."""
    torch.manual_seed(0)
    backbone = Llama(**{**SHAPE, **settings}, output_init="scaled").eval()
    with torch.no_grad():
        for parameter in backbone.parameters():
            if parameter.dim() == 1:
                parameter.normal_(1.0, 0.1)
    return backbone


def hugging_face_twin(backbone: Llama) -> PreTrainedModel:
    """Hugging Face's model of `backbone`'s shape, holding its weights under its names plus `model.`."""
    sizes = {
        "vocab_size": backbone.embed_tokens.num_embeddings,  # the padded rows, as the export writes them
        "hidden_size": backbone.d_model,
        "intermediate_size": backbone.mlp_width,
        "num_hidden_layers": len(backbone.layers),
        "num_attention_heads": backbone.n_head,
        "num_key_value_heads": backbone.n_kv_head,
        "head_dim": backbone.head_width,
        "hidden_act": backbone.activation,
        "max_position_embeddings": backbone.max_seq_len,
        "rms_norm_eps": backbone.norm_eps,
        "rope_theta": backbone.rope_theta,
        "tie_word_embeddings": backbone.lm_head is None,
    }
    model = Qwen3ForCausalLM(Qwen3Config(**sizes)) if backbone.qk_norm else LlamaForCausalLM(LlamaConfig(**sizes))
    weights = {name if name.startswith("lm_head") else f"model.{name}": w for name, w in backbone.state_dict().items()}
    weights.setdefault("lm_head.weight", backbone.head_weight)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def exported(backbone: Llama | Transformer, out: Path) -> Path:
    """The model files (no card or lineage) of `backbone` as a next-token model, written at `out`."""
    _, files = model_files(CausalLM(backbone, optimizer=torch.optim.AdamW), ByteTokenizer(), {})
    write_directory(out, files)
    return out


def greedy(model: CausalLM, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The template's greedy continuation of a one-row `prompt`, written out: at each step the most likely
    of the tokenizer's ids (never padding) after the whole sequence so far, until EOS."""
    tokens = prompt[0].tolist()
    for _ in range(new_tokens):
        with torch.no_grad():
            following = int(model(torch.tensor([tokens]))[0, -1, : model.backbone.vocab_size].argmax())
        tokens.append(following)
        if following == EOS_ID:
            break
    return tokens


def check_hugging_face_computes_the_template(model: CausalLM, directory: Path, architecture: type) -> None:
    """`directory` loads as `architecture` with every weight in place and no code of ours, and gives the
    template's logits and greedy continuation."""
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [architecture.__name__] and "auto_map" not in config
    assert not list(directory.glob("*.py"))
    hf, loading = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert type(hf) is architecture
    assert not any(loading[problem] for problem in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.tensor([ByteTokenizer().encode(TEXT)])
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), rtol=0, atol=1e-5)
    prompt = ids[:, :8]
    continuation = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False)
    assert continuation[0].tolist() == greedy(model, prompt, 32)


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_the_logits_are_hugging_faces(settings: dict[str, Any]) -> None:
    backbone = llama(**settings)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(
            backbone.logits(backbone(tokens)), hugging_face_twin(backbone)(tokens).logits, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("name", SETTINGS)
def test_an_export_is_hugging_faces_own_model_and_starts_a_llama_run_with_its_weights(
    name: str, tmp_path: Path
) -> None:
    backbone = llama(**SETTINGS[name])
    directory = exported(backbone, tmp_path / "out")
    check_hugging_face_computes_the_template(
        CausalLM(backbone, optimizer=torch.optim.AdamW).eval(), directory, ARCHITECTURE[name]
    )
    if backbone.lm_head is None:
        assert "lm_head.weight" not in load_file(directory / SAFETENSORS)  # tied: transformers ties it itself
    fresh = Llama(**{**SHAPE, **SETTINGS[name]})
    initialise_from(fresh, str(directory), ByteTokenizer())
    assert all(torch.equal(fresh.state_dict()[key], tensor) for key, tensor in backbone.state_dict().items())


def test_a_bidirectional_llama_has_no_export_and_the_fix_is_named() -> None:
    model = MaskedLM(Llama(**SHAPE, causal=False), optimizer=torch.optim.AdamW)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"^a MaskedLM Llama is bidirectional, .* train the encoder with model/backbone=transformer"
    ):
        model_files(model, ByteTokenizer(), {})


@pytest.mark.parametrize("number", [float("nan"), float("inf")])
def test_a_non_finite_setting_is_refused_naming_its_key_not_written_as_json_nan(number: float, tmp_path: Path) -> None:
    backbone = llama()
    backbone.rope_theta = number  # as a stored config from before its range refused it
    with pytest.raises(ConfigError, match=rf"^the export's rope_theta is {number}, a number JSON cannot hold: "):
        exported(backbone, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_init_from_refuses_a_model_of_the_other_kind_naming_both(tmp_path: Path) -> None:
    gpt2 = exported(Transformer(vocab_size=260, max_seq_len=64, d_model=64, n_layer=2, n_head=4), tmp_path / "gpt2")
    with pytest.raises(
        ConfigError,
        match=r"gpt2 holds a 'gpt2' model: .* starts from Llama models .* into this run's Llama backbone; a gpt2 "
        r"model starts a run with model/backbone=transformer$",
    ):
        initialise_from(llama(), str(gpt2), ByteTokenizer())
    qwen3 = exported(llama(qk_norm=True), tmp_path / "qwen3")
    with pytest.raises(
        ConfigError,
        match=r"qwen3 holds a 'qwen3' model: .* starts from GPT-2 models .* into this run's Transformer backbone; a "
        r"qwen3 model starts a run with model/backbone=llama$",
    ):
        initialise_from(Transformer(vocab_size=260), str(qwen3), ByteTokenizer())


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"n_kv_head": 4},
            r"has num_key_value_heads=2 \(model.backbone.n_kv_head=4\): pass model.backbone.n_kv_head=2$",
        ),
        (
            {"n_kv_head": 2, "qk_norm": True, "tie_head": False, "activation": "relu2", "rope_theta": 5e5},
            r"has hidden_act='silu' \(model.backbone.activation='relu2'\), rope_theta=10000.0 \(model.backbone."
            r"rope_theta=500000.0\), tie_word_embeddings=True \(model.backbone.tie_head=False\), model_type='llama' "
            r"\(model.backbone.qk_norm=True\): pass model.backbone.activation=silu model.backbone.rope_theta=10000.0 "
            r"model.backbone.tie_head=true model.backbone.qk_norm=false$",
        ),
        ({"n_kv_head": 2, "d_model": 32, "n_layer": 3}, r"hidden_size=64 \(model.backbone.d_model=32\), num_hidden_"),
        ({"n_kv_head": 2, "norm_eps": 1e-6}, r"has rms_norm_eps=1e-05 \(model.backbone.norm_eps=1e-06\): pass"),
        ({"n_kv_head": 2, "causal": False}, r"is llama, a causal model: start a causal objective from it"),
    ],
)
def test_init_from_names_each_setting_that_differs_and_its_override(
    tmp_path: Path, run: dict[str, Any], message: str
) -> None:
    directory = exported(llama(n_kv_head=2), tmp_path / "out")
    with pytest.raises(ConfigError, match=message):
        initialise_from(Llama(**{**SHAPE, **run}), str(directory), ByteTokenizer())


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"head_dim": 32}, r"has head_dim=32 \(model.backbone.head_dim=16\): pass model.backbone.head_dim=32$"),
        ({"hidden_size": None}, r"has no hidden_size in its config.json: it does not say the model's size$"),
        (
            {"attention_bias": True},
            r"has attention_bias=True \(model.backbone.attention_bias='none'\): pass .*attention_bias=all$",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"has rope_scaling=\{.*\}, and the backbone computes Llama 3's scaling from .* it lacks low_freq_factor, "
            r"high_freq_factor",
        ),
        (
            {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn"}},
            r"has rope_parameters.rope_type='yarn', and the backbone computes plain rotary positions",
        ),
        ({"rope_theta": None, "rope_parameters": {"rope_theta": 5e5}}, r"has rope_theta=500000.0 \(model.backbone"),
        ({"vocab_size": 100}, r"has vocab_size=100, not the 260 ids of the run's tokenizer at least"),
    ],
)
def test_init_from_reads_a_config_as_transformers_does_and_refuses_what_the_backbone_cannot_compute(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    directory = exported(llama(), tmp_path / "out")
    config = json.loads((directory / "config.json").read_text())
    config.update(edit)
    (directory / "config.json").write_text(
        json.dumps({key: value for key, value in config.items() if value is not None})
    )
    with pytest.raises(ConfigError, match=message):
        initialise_from(llama(), str(directory), ByteTokenizer())


def test_init_from_derives_the_sizes_an_older_config_leaves_out_as_transformers_does(tmp_path: Path) -> None:
    directory = exported(llama(), tmp_path / "out")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(
        json.dumps({key: value for key, value in config.items() if key not in ("num_key_value_heads", "head_dim")})
    )
    initialise_from(llama(), str(directory), ByteTokenizer())  # as many key/value heads, heads d_model / n_head wide


def test_init_from_refuses_weights_that_are_not_the_configs_model_before_loading_any(tmp_path: Path) -> None:
    directory = exported(llama(), tmp_path / "out")
    path, fresh = directory / SAFETENSORS, llama()
    weights = load_file(path)
    embedding, query = "model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"
    refusals = {
        r"has no tensor model.layers.1.self_attn.q_proj.weight: it is not a complete model": {query: None},
        r"has model.layers.1.self_attn.q_proj.weight of shape \(64, 32\), not \(64, 64\)": {
            query: weights[query][:, :32].contiguous()
        },
        r"has model.embed_tokens.weight of shape \(100, 64\), not \(at least 260, 64\)": {
            embedding: weights[embedding][:100].contiguous()
        },
        r"has a head apart from its token embedding, .* pass model.backbone.tie_head=false": {
            "lm_head.weight": weights[embedding] + 1
        },
    }
    for message, change in refusals.items():
        save_file({name: t for name, t in {**weights, **change}.items() if t is not None}, path)
        with pytest.raises(ConfigError, match=message):
            initialise_from(fresh, str(directory), ByteTokenizer())
    assert all(torch.equal(fresh.state_dict()[key], tensor) for key, tensor in llama().state_dict().items())
    (directory / "tokenizer.json").unlink()
    with pytest.raises(MissingFileError, match=r"tokenizer.json not found: .* pass the tokenizer it was trained with"):
        initialise_from(fresh, str(directory), ByteTokenizer())


# --- from training runs ------------------------------------------------------------------------------------

# The tiny next-token run with the Llama backbone: grouped-query attention (one key/value head), a head of its own.
LLAMA_RUN = ["model/backbone=llama", "model.backbone.n_kv_head=1", "model.backbone.tie_head=false"]


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory: pytest.TempPathFactory, shard_dir: Path) -> tuple[Path, Path]:
    """The last checkpoint of a six-step tiny Llama run, and its export."""
    root = tmp_path_factory.mktemp("llama")
    train(compose_run(root, "clm_tiny", shard_dir, *LLAMA_RUN))
    checkpoint = root / "checkpoints" / "last.ckpt"
    assert export(checkpoint, root / "export") == "llama"
    return checkpoint, root / "export"


def test_a_trained_llama_exports_as_hugging_faces_llama_with_its_tokenizer_and_card(
    llama_export: tuple[Path, Path],
) -> None:
    checkpoint, directory = llama_export
    model, examples = template(checkpoint)
    check_hugging_face_computes_the_template(model, directory, LlamaForCausalLM)  # type: ignore[arg-type]
    assert AutoTokenizer.from_pretrained(directory)(TEXT)["input_ids"] == examples.tokenizer.encode(TEXT)
    assert (
        "pipeline_tag: text-generation\ntags:\n- pretraining-template\n- llama\n"
        in (directory / "README.md").read_text()
    )
    assert json.loads((directory / "lineage.json").read_text())["export"]["kind"] == "llama"


def test_init_from_a_llama_export_starts_at_the_exported_models_loss(
    llama_export: tuple[Path, Path], tmp_path: Path, shard_dir: Path
) -> None:
    started_from_export(llama_export[1], tmp_path, shard_dir, *LLAMA_RUN)


def test_an_fsdp2_sharded_llama_checkpoint_exports_as_its_single_process_model(
    tmp_path: Path, small_shards: Path
) -> None:
    overrides = [*tiny_run("clm_tiny"), *SHARDED, f"data.dir={small_shards}", "model/backbone=llama"]
    assert pretrain(tmp_path, "fsdp", [*overrides, "model.backbone.qk_norm=true"]) == 0
    last = run_dir(tmp_path, "fsdp") / "checkpoints" / "last.ckpt"
    assert last.resolve().is_dir()
    assert export(last, tmp_path / "out") == "qwen3"
    check_hugging_face_computes_the_template(template(last)[0], tmp_path / "out", Qwen3ForCausalLM)  # type: ignore[arg-type]
