"""Continued pretraining of an open model: a directory as `save_pretrained` writes it (a tiny model built with
`transformers` itself, a tokenizer with its family's special tokens) is continued with its own tokenizer
(`tokenizer=hf`) and weights (`callbacks.init_from_hf`): the first step's loss is the model's loss in
`transformers`, a killed run resumes bitwise, and the export is the same architecture, loaded by
`transformers` alone with the logits and greedy tokens of the template's model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hf.families import family_tokenizer
from hf.test_export import init_from
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from conftest import TINY
from pretraining.callbacks.batch_log import read_batch_log
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR
from pretraining.extras.hf import directory as directory_module
from pretraining.extras.hf.directory import SAFETENSORS_INDEX
from pretraining.extras.hf.export import export
from pretraining.extras.hf.model_tokenizer import ModelTokenizer
from pretraining.instantiate import build
from pretraining.stored import load_checkpoint, stored_model
from pretraining.train import train
from test_resume import kill_twice_and_compare

TEXT = "def add(a, b):\n    return a + b  # naïve ☃"
# A run small enough for seconds of CPU (the model's sizes come from each family below).
SIZES_OF_TINY = ("model.backbone.d_model", "model.backbone.n_layer", "model.backbone.n_head")
RUN = ["experiment=clm_tiny", *(o for o in TINY if not o.startswith(SIZES_OF_TINY))]
RUN.append("callbacks.checkpoint.every_n_steps=4")  # the kill test's restarts go back to step 4 and 8
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
LLAMA = ["model/backbone=llama", "model.backbone.d_model=64", "model.backbone.mlp_width=96", "model.backbone.n_layer=2"]
LLAMA_EPS = "model.backbone.norm_eps=1e-6"  # transformers' default rms_norm_eps (the backbone's: 1e-5)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# family: (its config for a tokenizer of `ids` ids, its special tokens last; the tokenizer's family; the
# model.backbone overrides that say the same model)
STOCK: dict[str, tuple[Callable[[int], PretrainedConfig], str, list[str]]] = {
    "qwen3": (
        lambda ids: Qwen3Config(
            **SIZES, num_key_value_heads=2, head_dim=16, vocab_size=448, rope_theta=1e6, tie_word_embeddings=True
        ),
        "qwen",
        [
            *LLAMA,
            LLAMA_EPS,
            "model.backbone.n_kv_head=2",
            "model.backbone.qk_norm=true",
            "model.backbone.rope_theta=1000000.0",
        ],
    ),
    "qwen2-151936-rows": (  # Qwen's real vocabulary: 151,936 rows, scored 128 tokens at a time
        lambda ids: Qwen2Config(**SIZES, num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True),
        "qwen",
        [
            *LLAMA,
            "model.backbone.n_kv_head=1",
            "model.backbone.attention_bias=qkv",
            LLAMA_EPS,
            "model.loss_chunk_tokens=128",
        ],
    ),
    "qwen2": (
        lambda ids: Qwen2Config(**SIZES, num_key_value_heads=1, vocab_size=448, tie_word_embeddings=True),
        "qwen",
        [*LLAMA, "model.backbone.n_kv_head=1", "model.backbone.attention_bias=qkv", LLAMA_EPS],
    ),
    "llama3": (
        lambda ids: LlamaConfig(
            **SIZES,
            vocab_size=448,
            rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
            bos_token_id=ids - 2,
            eos_token_id=ids - 1,
        ),
        "llama3",
        [
            *LLAMA,
            "model.backbone.tie_head=false",
            "model.backbone.rope_theta=500000.0",
            LLAMA_EPS,
            "model.backbone.rope_scaling={" + ",".join(f"{key}:{value}" for key, value in LLAMA3_ROPE.items()) + "}",
        ],
    ),
    "llama2": (
        lambda ids: LlamaConfig(**SIZES, vocab_size=448, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
        "llama2",
        [*LLAMA, "model.backbone.tie_head=false"],
    ),
    "mistral": (
        lambda ids: MistralConfig(**SIZES, num_key_value_heads=2, vocab_size=448, sliding_window=None),
        "llama2",
        [*LLAMA, "model.backbone.n_kv_head=2", "model.backbone.tie_head=false", LLAMA_EPS],
    ),
    "gpt2": (
        lambda ids: GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=ids, bos_token_id=ids - 1, eos_token_id=ids - 1
        ),
        "gpt2",
        [
            "model.backbone.d_model=64",
            "model.backbone.n_layer=2",
            "model.backbone.n_head=4",
            "model.backbone.bias=true",
            "model.backbone.activation=gelu_tanh",
            "model.backbone.pad_vocabulary=false",  # its vocabulary (401 ids) is no multiple of 64
        ],
    ),
}


def stock_model(family: str, directory: Path) -> Path:
    """`family`'s tiny model with random weights (norms and biases too), saved with its tokenizer as the hub has
    them."""
    make_config, tokenizer_family, _ = STOCK[family]
    tokenizer = Tokenizer.from_file(str(family_tokenizer(tokenizer_family, directory) / "tokenizer.json"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(tokenizer.get_vocab_size()))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    model.save_pretrained(directory)
    return directory


def continuing(family: str, directory: Path) -> list[str]:
    """The overrides that continue `directory`, a `family` model, with its own tokenizer and weights."""
    return [*RUN, *STOCK[family][2], "tokenizer=hf", f"tokenizer.path={directory}", *init_from(directory, "batch_log")]


def compose_run(root: Path, data_dir: Path, overrides: list[str]) -> DictConfig:
    paths = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={data_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=[*paths, *overrides])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stock_model("qwen3", tmp_path_factory.mktemp("models") / "qwen3")


@pytest.mark.parametrize("family", STOCK)
def test_the_first_step_is_the_models_loss(family: str, tmp_path: Path, shard_dir: Path) -> None:
    directory = stock_model(family, tmp_path / family)
    overrides = [*continuing(family, directory), "validate_before_training=false", "trainer.max_steps=1"]
    cfg = compose_run(tmp_path / "run", shard_dir, overrides)
    train(cfg)
    (first,) = read_batch_log(tmp_path / "run" / "batches" / "rank0.jsonl").values()
    datamodule = build(cfg.data, tokenizer=build(cfg.tokenizer))
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["sample_id"].tolist() == first["samples"]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = batch["tokens"]
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert float.fromhex(first["loss"]) == pytest.approx(loss.item(), abs=1e-4)


def test_a_killed_continued_run_resumes_bitwise(qwen3: Path, tmp_path: Path, shard_dir: Path) -> None:
    kill_twice_and_compare(
        tmp_path, [*continuing("qwen3", qwen3), f"data.dir={shard_dir}"], kills=(5, 10), max_steps=12
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral", "llama3", "gpt2"])
def test_the_export_is_the_same_architecture_loaded_by_transformers_alone(
    family: str, tmp_path: Path, shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3 (QK-norm, more rows than ids), Qwen2 (q/k/v biases), Mistral (SentencePiece, a BOS), Llama 3 (its
    RoPE scaling, a BOS, an untied head) and GPT-2 (an odd vocabulary, biases): each goes out as it came in, in
    shards (their size made tiny), through `pretrain-export`'s own function (the card included)."""
    directory = stock_model(family, tmp_path / family)
    train(compose_run(tmp_path / "run", shard_dir, [*continuing(family, directory), "trainer.max_steps=4"]))
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    out = tmp_path / "export"
    monkeypatch.setattr(directory_module, "MAX_SHARD_BYTES", 100_000)
    export(checkpoint, out)
    assert len(json.loads((out / SAFETENSORS_INDEX).read_text())["weight_map"]) > 1
    original, exported = (json.loads((path / "config.json").read_text()) for path in (directory, out))
    assert exported == {**original, "dtype": "float32"}  # model_type, architectures, vocab_size, ids: the same
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (directory / name).read_bytes()
    model, _, examples = stored_model(load_checkpoint(checkpoint), str(checkpoint))
    tokenizer = examples.tokenizer
    assert isinstance(tokenizer, ModelTokenizer)
    prompt = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        logits = model.eval()(prompt)[..., : tokenizer.vocab_size]
    greedy = model.generate(prompt, 12, top_k=1, eos_id=tokenizer.eos_id)[0, prompt.shape[1] :].tolist()
    theirs = in_transformers_alone(out)
    assert theirs["ids"] == prompt[0].tolist()
    assert torch.allclose(torch.tensor(theirs["logits"]), logits[0], atol=1e-5, rtol=0)
    assert theirs["greedy"] == greedy


def in_transformers_alone(directory: Path) -> dict[str, Any]:
    """What `transformers` makes of the export, in a process where this package cannot be imported."""
    script = f"""
import json, sys
sys.modules["pretraining"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(directory)!r})
model = AutoModelForCausalLM.from_pretrained({str(directory)!r}).eval()
ids = tokenizer({TEXT!r}, return_tensors="pt", add_special_tokens=False).input_ids
with torch.no_grad():
    logits = model(ids).logits[0]
    greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
print(json.dumps({{"ids": ids[0].tolist(), "logits": logits.tolist(), "greedy": greedy[0, ids.shape[1]:].tolist()}}))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_lineage_names_the_directory_and_keeps_its_config(
    qwen3: Path, tmp_path: Path, shard_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    train(compose_run(tmp_path / "run", shard_dir, [*continuing("qwen3", qwen3), "trainer.max_steps=2"]))
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    origin = load_checkpoint(checkpoint)["lineage"]["origin"]
    assert origin["init_from"] == str(qwen3.resolve())
    assert origin["config"] == json.loads((qwen3 / "config.json").read_text())
    capsys.readouterr()
    info_main([str(checkpoint)])
    assert f"{qwen3.resolve()} (callbacks.init_from_hf)" in capsys.readouterr().out
