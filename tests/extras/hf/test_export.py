"""Models out to Hugging Face and back in: each objective's export loads in `transformers` (and
`sentence-transformers`) and computes what the template computes; `callbacks.init_from_hf` continues from an
export; every bad input is refused before anything is written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
)

from conftest import tiny_run
from pretraining.callbacks.batch_log import read_batch_log
from pretraining.checkpoint import read_sidecar, sidecar_path
from pretraining.checkpoint import save_file as save_file_with_sidecar
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR
from pretraining.data.formats import ExampleFormat, padded
from pretraining.data.tokenizer import PAD_ID, ByteTokenizer
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.extras.hf.cli import main
from pretraining.extras.hf.directory import SAFETENSORS, write_directory
from pretraining.extras.hf.export import export, model_files
from pretraining.extras.hf.weights import check_gpt2_fits, gpt2_config, load_gpt2, to_gpt2
from pretraining.instantiate import build
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive, retrieval_ranks
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.stored import load_checkpoint, stored_model
from pretraining.train import train
from test_head import SoftCapped
from test_readme import code_blocks
from test_resume import pretrain, run_dir
from test_sharded_checkpoint import SHARDED

# Two layers (a mix-up of layer indices would show); biases and the CLS pooling where an objective allows.
SHAPES = {
    "clm_tiny": ["model.backbone.n_layer=2"],
    "mlm_tiny": ["model.backbone.n_layer=2", "model.backbone.bias=true"],
    "contrastive_tiny": ["model.backbone.n_layer=2", "model.backbone.bias=true", "model.pooling=first"],
    "clm_modern": ["model.backbone.n_layer=2"],
}
TEXT = "def add(a, b):\n    return a + b  # naïve ☃"
EXPERIMENTS = ("clm_tiny", "mlm_tiny", "contrastive_tiny")


def init_from(directory: Path | str, *callbacks: str) -> list[str]:
    """The overrides that start a fresh run from `directory` (the default callbacks, `callbacks`, and init_from)."""
    listed = ",".join(["default", *callbacks, "init_from_hf"])
    return [f"callbacks=[{listed}]", f"callbacks.init_from_hf.path={directory}"]


def compose_run(root: Path, experiment: str, data_dir: Path, *overrides: str) -> DictConfig:
    base = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={data_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        shape = SHAPES[experiment]
        return compose("train", overrides=[*base, *tiny_run(experiment), *shape, "trainer.max_steps=6", *overrides])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, shard_dir: Path, pair_dir: Path) -> dict[str, Path]:
    """The last checkpoint of a six-step tiny run of each objective."""
    paths = {}
    for experiment in EXPERIMENTS:
        root = tmp_path_factory.mktemp(experiment)
        data = pair_dir if experiment == "contrastive_tiny" else shard_dir
        train(compose_run(root, experiment, data))
        paths[experiment] = root / "checkpoints" / "last.ckpt"
    return paths


@pytest.fixture(scope="module")
def exports(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exports")
    for experiment, checkpoint in checkpoints.items():
        export(checkpoint, out / experiment)
    return out


def template(checkpoint: Path) -> tuple[PretrainingObjective, ExampleFormat]:
    """The template's own model, in eval mode, and example format of a checkpoint."""
    model, _, examples = stored_model(load_checkpoint(checkpoint), str(checkpoint))
    return model.eval(), examples


def test_a_next_token_model_is_gpt2_with_the_templates_logits_tokens_and_greedy_continuation(
    checkpoints: dict[str, Path], exports: Path
) -> None:
    model, examples = template(checkpoints["clm_tiny"])
    tokenizer = AutoTokenizer.from_pretrained(exports / "clm_tiny")
    hf = AutoModelForCausalLM.from_pretrained(exports / "clm_tiny").eval()
    assert isinstance(hf, GPT2LMHeadModel)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == examples.tokenizer.encode(TEXT)
    assert tokenizer("a <eos> b")["input_ids"] == examples.tokenizer.encode("a <eos> b")  # text, as in training
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)
    prompt = ids[:, :8]
    greedy = hf.generate(prompt, max_new_tokens=24, do_sample=False)
    assert greedy[0].tolist() == model.generate(prompt, 24, top_k=1)[0].tolist()
    assert tokenizer.decode(ids[0]) == TEXT


def test_generation_never_picks_the_padded_vocabulary(checkpoints: dict[str, Path], exports: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(exports / "clm_tiny").eval()
    vocab = template(checkpoints["clm_tiny"])[1].tokenizer.vocab_size
    with torch.no_grad():  # make every padded id the most likely next token
        hf.transformer.wte.weight[vocab:] = hf.transformer.wte.weight[:vocab].sum(0) * 100
    generated = hf.generate(torch.tensor([[70, 71, 72]]), max_new_tokens=8, do_sample=False)
    assert generated.max() < vocab


def test_a_masked_lm_loads_with_its_own_code_and_gives_the_templates_logits(
    checkpoints: dict[str, Path], exports: Path
) -> None:
    model = template(checkpoints["mlm_tiny"])[0]
    tokenizer = AutoTokenizer.from_pretrained(exports / "mlm_tiny", trust_remote_code=True)
    hf = AutoModelForMaskedLM.from_pretrained(exports / "mlm_tiny", trust_remote_code=True).eval()
    inputs = tokenizer(TEXT.replace("add", "<mask><mask>"), return_tensors="pt")
    assert (inputs["input_ids"] == tokenizer.mask_token_id).sum() == 2 and tokenizer.mask_token_id == 2
    with torch.no_grad():
        expected = model.backbone(inputs["input_ids"])
        torch.testing.assert_close(hf(**inputs).logits, model.backbone.logits(expected), rtol=0, atol=1e-5)
        encoder = AutoModel.from_pretrained(exports / "mlm_tiny", trust_remote_code=True).eval()
        torch.testing.assert_close(encoder(**inputs).last_hidden_state, expected, rtol=0, atol=1e-5)
    masked = inputs["input_ids"] == tokenizer.mask_token_id
    labels = torch.full_like(inputs["input_ids"], -100).masked_fill(masked, 70)
    with torch.no_grad():
        expected_loss = F.cross_entropy(model.backbone.logits(expected)[masked], labels[masked])
        torch.testing.assert_close(hf(**inputs, labels=labels).loss, expected_loss, rtol=0, atol=1e-5)


def test_a_contrastive_model_is_a_sentence_transformer_with_the_templates_embeddings(
    checkpoints: dict[str, Path], exports: Path
) -> None:
    model, examples = template(checkpoints["contrastive_tiny"])
    encoder = SentenceTransformer(str(exports / "contrastive_tiny"), trust_remote_code=True, device="cpu")
    texts = [TEXT, "Return the sum.", "x = 1\n" * 80]  # the last is cut to the passage length, as in training
    length = examples.lengths["passage_len"]
    batch = torch.stack([padded(examples.encode_text(text, length), length) for text in texts])
    with torch.no_grad():
        expected = model.encode(batch, "passage")
    torch.testing.assert_close(torch.from_numpy(encoder.encode(texts)), expected, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(exports / "contrastive_tiny", trust_remote_code=True)
    assert tokenizer(TEXT)["input_ids"] == examples.encode_text(TEXT, 10_000)  # CLS first, then the BPE ids


def test_a_second_stage_with_hard_negatives_exports_the_embeddings_and_retrieval_it_validated(
    checkpoints: dict[str, Path], tmp_path: Path, negatives_dir: Path
) -> None:
    """The masked-LM's backbone (rotary positions) into a contrastive run on mined hard negatives, exported: the
    same embeddings in sentence-transformers, and from them the validation's MRR each way."""
    stage_two = [
        "tokenizer=bytes",
        "model/backbone=transformer_rotary",
        "data.format.hard_negatives=2",
        "callbacks=[default,init_from]",
        f"callbacks.init_from.path={checkpoints['mlm_tiny']}",
        "trainer.val_check_interval=6",
    ]
    metrics = train(compose_run(tmp_path / "run", "contrastive_tiny", negatives_dir, *stage_two))
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert load_checkpoint(checkpoint)["lineage"]["origin"]["loaded"] == "the backbone"
    export(checkpoint, tmp_path / "export")
    model, examples = template(checkpoint)
    encoder = SentenceTransformer(str(tmp_path / "export"), trust_remote_code=True, device="cpu")
    cfg = compose_run(tmp_path / "run", "contrastive_tiny", negatives_dir, *stage_two)
    data = build(cfg.data, tokenizer=build(cfg.tokenizer))
    pairs = sorted(data.validation_sets[0], key=lambda pair: int(pair["sample_id"]))

    def text(ids: torch.Tensor) -> str:  # the text a side's ids (CLS first, PAD after) stand for
        return examples.tokenizer.decode(ids[1:][ids[1:] != PAD_ID].tolist())

    decoded = {side: [text(pair[side]) for pair in pairs] for side in ("query", "passage")}
    with torch.no_grad():
        expected = {side: model.encode(torch.stack([pair[side] for pair in pairs]), side) for side in decoded}
    embedded = {side: torch.from_numpy(encoder.encode(texts)) for side, texts in decoded.items()}
    for side in decoded:
        torch.testing.assert_close(embedded[side], expected[side], rtol=0, atol=1e-5)
    for direction, (asked, answers) in {"q2p": ("query", "passage"), "p2q": ("passage", "query")}.items():
        mrr = float((1 / retrieval_ranks(embedded[asked], embedded[answers]).double()).mean())
        assert mrr == pytest.approx(metrics[f"val/{direction}_mrr"], abs=1e-3)  # embeddings equal to 1e-5: near-ties


def test_a_masked_lm_cards_tokenizer_loads_without_the_directorys_code_a_prompt_or_a_warning(
    exports: Path, tmp_path: Path
) -> None:
    """AutoTokenizer reads config.json, whose auto_map needs the modelling code: without trust_remote_code it asks
    [y/N] (on a terminal), then warns of the model type. The card loads the plain tokenizer, which needs no code."""
    copy = copy_export(exports / "mlm_tiny", tmp_path / "mlm_tiny", leave_out="modeling_pretraining.py")
    card = (copy / "README.md").read_text().split("```python\n")[1].split("```")[0]
    lines = [line for line in card.splitlines() if line.startswith(("from transformers", "tokenizer ="))]
    script = "\n".join([*lines, f"print(tokenizer({TEXT!r}).input_ids)"]).replace(
        repr(str(exports / "mlm_tiny")), repr(str(copy))
    )
    result = subprocess.run(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, capture_output=True, text=True, timeout=120
    )  # stdin stays open: a prompt would wait for an answer
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == ByteTokenizer().encode(TEXT)
    assert "[y/N]" not in result.stdout + result.stderr and "model of type" not in result.stderr


def test_the_model_card_and_lineage_name_the_checkpoint_run_and_validation(
    checkpoints: dict[str, Path], exports: Path
) -> None:
    checkpoint = checkpoints["clm_tiny"]
    sidecar = read_sidecar(checkpoint.resolve())
    record = json.loads((exports / "clm_tiny" / "lineage.json").read_text())
    assert record["checkpoint_sha256"] == sidecar["sha256"] and record["lineage"]["step"] == 6
    assert record["validation"] == sidecar["validation"] and "val/bpb" in record["validation"]
    assert record["lineage"]["config"]["model"]["_target_"] == "pretraining.objectives.causal_lm.CausalLM"
    card = (exports / "clm_tiny" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation")
    assert f"| val/bpb | {sidecar['validation']['val/bpb']:.4f} |" in card
    assert record["lineage"]["data_version"] in card and "at step 6" in card


def test_the_gpt2_mapping_is_exact_for_biases_and_every_layer() -> None:
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=100, max_seq_len=16, d_model=32, n_layer=3, n_head=4, bias=True).eval()
    with torch.no_grad():
        for name, parameter in backbone.named_parameters():
            if not name.endswith("weight") or "norm" in name:  # random biases and norms: none is left at its init
                parameter.normal_()
    hf = GPT2LMHeadModel(GPT2Config(**gpt2_config(backbone))).eval()
    missing, unexpected = hf.load_state_dict(to_gpt2(backbone), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the tied head
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, backbone.logits(backbone(ids)), rtol=0, atol=1e-5)
    fresh = Transformer(vocab_size=100, max_seq_len=16, d_model=32, n_layer=3, n_head=4, bias=True)
    load_gpt2(to_gpt2(backbone), fresh, "test")
    assert all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in backbone.state_dict().items())


@pytest.mark.parametrize("objective", [CausalLM, MaskedLM])
def test_a_backbone_with_a_head_of_its_own_is_refused(objective: type) -> None:
    backbone = SoftCapped(vocab_size=100, max_seq_len=16, d_model=32, n_layer=1, n_head=2, causal=objective is CausalLM)
    with pytest.raises(ConfigError, match="overrides its head"):  # the architectures end in the plain projection
        model_files(objective(backbone, optimizer=torch.optim.AdamW), ByteTokenizer(), {})


@pytest.mark.parametrize("objective", [CausalLM, MaskedLM, Contrastive])
def test_a_model_of_other_rules_than_standard_is_refused(objective: type) -> None:
    backbone = Transformer(
        vocab_size=100,
        d_model=64,
        n_layer=1,
        n_head=2,
        causal=objective is CausalLM,
        parametrization="mup",
        base_width=32,
    )
    with pytest.raises(
        ConfigError, match=r"under model.backbone.parametrization=mup at 2x its base width, .*, whose multipliers"
    ):
        model_files(objective(backbone, optimizer=torch.optim.AdamW), ByteTokenizer(), {"passage_len": 16})


def test_an_fsdp2_sharded_checkpoint_exports_as_its_single_process_model(tmp_path: Path, small_shards: Path) -> None:
    assert pretrain(tmp_path, "fsdp", [*tiny_run("clm_tiny"), *SHARDED, f"data.dir={small_shards}"]) == 0
    last = run_dir(tmp_path, "fsdp") / "checkpoints" / "last.ckpt"
    assert last.resolve().is_dir()
    export(last, tmp_path / "out")
    model, examples = template(last)
    ids = torch.tensor([examples.tokenizer.encode(TEXT)])
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=1e-5)


def test_the_readme_snippet_and_every_model_cards_usage_run_without_this_package(
    exports: Path, tmp_path: Path, shard_dir: Path
) -> None:
    (snippet,) = [block for block in code_blocks("python") if "# use_export.py" in block]
    (tmp_path / "exports").mkdir()
    root = tmp_path / "run"
    train(compose_run(root, "clm_modern", shard_dir))  # the docs' exports/clm_modern: a Llama
    export(root / "checkpoints" / "last.ckpt", tmp_path / "exports" / "clm_modern")
    cards = [(exports / name / "README.md").read_text().split("```python\n")[1].split("```")[0] for name in EXPERIMENTS]
    script = "\n".join(["import sys", "sys.modules['pretraining'] = None  # importing it fails", snippet, *cards])
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("def main(")


# --- starting from an export ------------------------------------------------------------------------------


def started_from_export(directory: Path, tmp_path: Path, shard_dir: Path, *overrides: str) -> dict[str, Any]:
    """Train two steps of a run started from the export `directory`; check that its first batch's loss is the
    exported model's loss on that batch (in transformers), and return the run's recorded origin."""
    cfg = compose_run(
        tmp_path,
        "clm_tiny",
        shard_dir,
        *overrides,
        *init_from(directory, "batch_log"),
        "validate_before_training=false",
        "trainer.max_steps=2",
        "model.warmup_steps=0",
    )
    train(cfg)
    log = read_batch_log(tmp_path / "batches" / "rank0.jsonl")
    first = log[min(log)]
    datamodule = build(cfg.data, tokenizer=build(cfg.tokenizer))
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["sample_id"].tolist() == first["samples"]
    hf = AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = batch["tokens"]
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert float.fromhex(first["loss"]) == pytest.approx(loss.item(), abs=1e-5)
    origin = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["lineage"]["origin"]
    assert origin["init_from"] == str(directory.resolve()) and origin["exported_from"]["step"] == 6
    return origin


def test_init_from_an_export_starts_at_the_exported_models_loss(exports: Path, tmp_path: Path, shard_dir: Path) -> None:
    origin = started_from_export(exports / "clm_tiny", tmp_path, shard_dir)
    assert set(origin["weights_sha256"]) == {"model.safetensors"}


def test_a_run_started_from_a_directory_no_longer_needs_it(
    exports: Path, tmp_path: Path, shard_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = copy_export(exports / "clm_tiny", tmp_path / "model")
    latest = tmp_path / "latest"
    latest.symlink_to(directory)  # named through a link, which will be gone too
    run = tmp_path / "run"
    train(compose_run(run, "clm_tiny", shard_dir, *init_from(latest), "trainer.max_steps=3"))
    other = copy_export(exports / "clm_tiny", tmp_path / "other")
    with pytest.raises(
        ConfigError, match=r"callbacks.init_from_hf.path=.*other applies to a fresh run, .* started from .*latest"
    ):
        train(compose_run(run, "clm_tiny", shard_dir, *init_from(other), "trainer.max_steps=6"))
    latest.unlink()
    for file in directory.iterdir():
        file.unlink()
    directory.rmdir()
    train(compose_run(run, "clm_tiny", shard_dir, *init_from(latest), "trainer.max_steps=6"))
    last = run / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 6
    export(last, tmp_path / "out")  # rebuilt from its stored config, which names the directory
    started = f"{directory.resolve()} (callbacks.init_from_hf), exported from"
    assert f"| weights from | {started}" in (tmp_path / "out" / "README.md").read_text()
    capsys.readouterr()
    info_main([str(last)])
    assert re.search(rf"\norigin +{re.escape(started)}", capsys.readouterr().out)


def copy_export(source: Path, out: Path, leave_out: str = "") -> Path:
    out.mkdir()
    for file in source.iterdir():
        if file.is_file() and file.name != leave_out:
            (out / file.name).write_bytes(file.read_bytes())
    return out


def refused_start(cfg: DictConfig, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        train(cfg)
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()


def test_init_from_refuses_another_size_naming_the_overrides(exports: Path, tmp_path: Path, shard_dir: Path) -> None:
    cfg = compose_run(tmp_path, "clm_tiny", shard_dir, *init_from(exports / "clm_tiny"), "model.backbone.d_model=64")
    refused_start(cfg, ConfigError, r"has n_embd=32 \(model.backbone.d_model=64\): pass model.backbone.d_model=32")


def test_init_from_refuses_to_read_a_standard_model_under_other_rules(
    exports: Path, tmp_path: Path, shard_dir: Path
) -> None:
    rules = ["model.backbone.parametrization=mup", "model.backbone.base_width=16"]
    cfg = compose_run(tmp_path, "clm_tiny", shard_dir, *init_from(exports / "clm_tiny"), *rules)
    refused_start(
        cfg, ConfigError, r"parametrization=mup at 2x its base width, .*, and .* holds a standard one: start from it"
    )


def test_init_from_refuses_gpt2_for_a_bidirectional_objective(exports: Path, tmp_path: Path, shard_dir: Path) -> None:
    cfg = compose_run(tmp_path, "mlm_tiny", shard_dir, *init_from(exports / "clm_tiny"))
    refused_start(cfg, ConfigError, r"is GPT-2, a causal model: start a causal objective from it")


def test_init_from_refuses_another_tokenizer(exports: Path, tmp_path: Path, shard_dir: Path, bpe_path: Path) -> None:
    init = init_from(exports / "clm_tiny")
    cfg = compose_run(tmp_path, "clm_tiny", shard_dir, *init, "tokenizer=bpe", f"tokenizer.path={bpe_path}")
    refused_start(cfg, ConfigError, r"tokenizes differently .* its vocabulary has 260 tokens, the run's 320")


@pytest.mark.parametrize(
    ("source", "leave_out", "error", "message"),
    [
        (
            "mlm_tiny",
            "",
            ConfigError,
            r"holds a 'pretraining-transformer' model: callbacks.init_from_hf starts from GPT-2",
        ),
        ("clm_tiny", "tokenizer.json", MissingFileError, r"tokenizer.json not found: .* pass the tokenizer"),
        ("clm_tiny", "config.json", MissingFileError, r"config.json not found: .* is not a Hugging Face model"),
        ("clm_tiny", "model.safetensors", MissingFileError, r"has no model.safetensors, .* no weights to start from"),
    ],
)
def test_init_from_refuses_what_it_cannot_start_from(
    exports: Path, tmp_path: Path, shard_dir: Path, source: str, leave_out: str, error: type, message: str
) -> None:
    directory = copy_export(exports / source, tmp_path / "model", leave_out)
    cfg = compose_run(tmp_path / "run", "clm_tiny", shard_dir, *init_from(directory))
    refused_start(cfg, error, message)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda config: config.pop("activation_function"),
            r"activation_function='gelu_new' \(model.backbone.activation='gelu'\): pass .*activation=gelu_tanh$",
        ),
        (
            lambda config: config.update(scale_attn_weights=False),
            r"scale_attn_weights=False, and the backbone computes",
        ),
        (lambda config: config.update(add_cross_attention=True), r"add_cross_attention=True, and the backbone"),
        (lambda config: config.update(vocab_size=100), r"vocab_size=100, not the 260 ids of the run's tokenizer"),
        (lambda config: config.update(n_embd="32"), r"has n_embd='32' \(model.backbone.d_model=32\): pass"),
    ],
)
def test_init_from_reads_absent_keys_as_gpt2s_defaults(
    exports: Path, tmp_path: Path, shard_dir: Path, edit, message: str
) -> None:
    directory = copy_export(exports / "clm_tiny", tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    refused_start(compose_run(tmp_path / "run", "clm_tiny", shard_dir, *init_from(directory)), ConfigError, message)


def test_init_from_names_a_damaged_file(exports: Path, tmp_path: Path, shard_dir: Path) -> None:
    directory = copy_export(exports / "clm_tiny", tmp_path / "model")
    cfg = compose_run(tmp_path / "run", "clm_tiny", shard_dir, *init_from(directory))
    (directory / "lineage.json").write_text("[1, 2]")
    refused_start(cfg, ConfigError, r"lineage.json holds no JSON object")
    (directory / "lineage.json").unlink()
    weights = load_file(directory / "model.safetensors")
    save_file(
        {**weights, "transformer.wpe.weight": weights["transformer.wpe.weight"][:8]}, directory / "model.safetensors"
    )
    refused_start(cfg, ConfigError, r"has transformer.wpe.weight of shape \(8, 32\), not \(64, 32\): it does not fit")
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors.index.json").write_text("{not json")
    refused_start(cfg, ConfigError, r"model.safetensors.index.json is not valid JSON")
    (directory / "model.safetensors.index.json").unlink()
    torch.save(weights, directory / "pytorch_model.bin")
    (directory / "pytorch_model.bin").write_bytes((directory / "pytorch_model.bin").read_bytes()[:300])
    refused_start(cfg, ConfigError, r"pytorch_model.bin cannot be read .* it is damaged")


def test_init_from_refuses_weights_it_cannot_use_and_code_in_them(
    exports: Path, tmp_path: Path, shard_dir: Path
) -> None:
    directory = copy_export(exports / "clm_tiny", tmp_path / "model")
    cfg = compose_run(tmp_path / "run", "clm_tiny", shard_dir, *init_from(directory))
    path = directory / "model.safetensors"
    weights = load_file(path)
    bias, head = "transformer.h.1.ln_1.bias", "transformer.wte.weight"
    refusals = {
        r"transformer.h.1.ln_1.bias of shape \(\), not \(32,\)": {bias: torch.tensor(0.0)},
        r"ln_1.bias with non-finite values": {bias: torch.full((32,), float("nan"))},
        r"ln_1.bias with torch.int64: it holds no usable weights": {bias: torch.zeros(32, dtype=torch.int64)},
        r"non-zero transformer.h.1.ln_1.bias, .* pass model.backbone.bias=true": {bias: torch.ones(32)},
        r"has a head apart from its token embedding": {"lm_head.weight": weights[head] + 1},
    }
    for message, change in refusals.items():
        save_file({**weights, **change}, path)
        refused_start(cfg, ConfigError, message)
    path.write_bytes(path.read_bytes()[:100])
    refused_start(cfg, ConfigError, r"model.safetensors cannot be read .* it is damaged")
    path.unlink()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    torch.save({"transformer.wte.weight": Payload()}, directory / "pytorch_model.bin")
    refused_start(cfg, CheckpointError, r"pytorch_model.bin holds objects other than tensors")
    assert not marker.exists()


def test_init_from_reads_a_sharded_index_of_unprefixed_weights_and_only_files_beside_it(
    exports: Path, tmp_path: Path, shard_dir: Path
) -> None:
    directory = copy_export(exports / "clm_tiny", tmp_path / "model", leave_out="model.safetensors")
    weights = {
        name.removeprefix("transformer."): t for name, t in load_file(exports / "clm_tiny" / SAFETENSORS).items()
    }
    names = sorted(weights)
    parts = {"part-1.safetensors": names[: len(names) // 2], "part-2.safetensors": names[len(names) // 2 :]}
    for part, keys in parts.items():
        save_file({key: weights[key] for key in keys}, directory / part)
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {key: part for part, keys in parts.items() for key in keys}}))
    run = tmp_path / "run"
    train(compose_run(run, "clm_tiny", shard_dir, *init_from(directory), "trainer.max_steps=3"))
    started = load_checkpoint(run / "checkpoints" / "last.ckpt")["lineage"]["origin"]["weights_sha256"]
    assert set(started) == set(parts)
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((directory / "part-1.safetensors").read_bytes())
    for named in (str(outside), "gone.safetensors", ["part-1.safetensors"]):
        index.write_text(json.dumps({"weight_map": {names[0]: named}}))
        cfg = compose_run(tmp_path / "other", "clm_tiny", shard_dir, *init_from(directory))
        refused_start(cfg, ConfigError, r"index.json names .*, which is not a file beside it")


def test_resume_never_with_a_start_that_is_not_there_keeps_the_earlier_run(tmp_path: Path, shard_dir: Path) -> None:
    train(compose_run(tmp_path, "clm_tiny", shard_dir, "trainer.max_steps=3"))
    cfg = compose_run(tmp_path, "clm_tiny", shard_dir, "resume=never", *init_from(tmp_path / "gone"))
    with pytest.raises(MissingFileError, match=r"gone: no such checkpoint, run or model directory"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and not list(tmp_path.glob("replaced-*"))


# --- bad exports ------------------------------------------------------------------------------------------


def test_export_refuses_a_non_empty_destination_and_an_unverified_checkpoint(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match=r"taken already exists and is not an empty directory: choose a new"):
        export(checkpoints["clm_tiny"], tmp_path / "taken")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"file/out cannot be created: .*file is not a writable directory"):
        export(checkpoints["clm_tiny"], tmp_path / "file" / "out")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(
        ConfigError, match=rf"link is a symbolic link \(to {tmp_path / 'empty'}\): name a new directory"
    ):
        export(checkpoints["clm_tiny"], tmp_path / "link")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
    original = checkpoints["clm_tiny"].resolve()
    damaged = tmp_path / original.name
    data = bytearray(original.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    sidecar_path(damaged).write_bytes(sidecar_path(original).read_bytes())
    with pytest.raises(CheckpointError, match=r"does not match the SHA-256 in its sidecar: it is corrupt"):
        export(damaged, tmp_path / "out")
    sidecar_path(damaged).unlink()
    with pytest.raises(CheckpointError, match=r"has no sidecar .* use another checkpoint"):
        export(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_names_a_missing_or_other_tokenizer_and_the_option_to_pass(
    checkpoints: dict[str, Path], tmp_path: Path, bpe_path: Path
) -> None:
    checkpoint = checkpoints["contrastive_tiny"]
    with pytest.raises(MissingFileError, match=r"trained with, .*gone.json, is not there: .* --tokenizer PATH"):
        export(checkpoint, tmp_path / "out", tokenizer_path=str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match=r"is not the one this checkpoint was trained with"):
        export(checkpoint, tmp_path / "out", tokenizer_path=str(bpe_path))
    with pytest.raises(
        ConfigError,
        match=r"tokenizer \(pretraining.data.tokenizer.ByteTokenizer\) reads no file: leave out --tokenizer PATH",
    ):
        export(checkpoints["clm_tiny"], tmp_path / "out", tokenizer_path=str(bpe_path))
    assert not (tmp_path / "out").exists()


def test_the_command_prints_refusals_without_a_traceback(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    with pytest.raises(SystemExit, match=r"^pretrain-export: checkpoint .*nope.ckpt not found"):
        main([str(tmp_path / "nope.ckpt"), str(tmp_path / "out")])
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json")
    with pytest.raises(SystemExit, match=r"^pretrain-export: .*garbage.json is not a tokenizer.json"):
        main([str(checkpoints["contrastive_tiny"]), str(tmp_path / "out"), "--tokenizer", str(garbage)])
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(SystemExit, match=r"^pretrain-export: \. is the current directory: name a new directory"):
        main([str(checkpoints["mlm_tiny"]), "."])
    main([str(checkpoints["mlm_tiny"]), str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out and (tmp_path / "out" / "modeling_pretraining.py").is_file()


def test_a_stored_config_that_cannot_be_rebuilt_is_refused_in_one_line_naming_the_file(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    trained = torch.load(checkpoints["clm_tiny"], weights_only=True)
    path = tmp_path / "crafted.ckpt"
    for key, refusal in [("${oc.env:HOME}", "is an interpolation"), ("unknown_setting", "cannot be rebuilt")]:
        trained["lineage"]["config"]["model"] = {**trained["lineage"]["config"]["model"], key: 1}
        save_file_with_sidecar(trained, path)
        with pytest.raises(SystemExit, match=rf"^pretrain-export: .*the config stored in {path} {refusal}[^\n]*$"):
            main([str(path), str(tmp_path / "out")])
        del trained["lineage"]["config"]["model"][key]
    assert not (tmp_path / "out").exists()


def test_export_names_its_own_option_to_trust_a_module(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    trained = torch.load(checkpoints["clm_tiny"], weights_only=True)
    trained["lineage"]["config"]["model"]["_target_"] = "collections.OrderedDict"
    path = tmp_path / "crafted.ckpt"
    save_file_with_sidecar(trained, path)
    with pytest.raises(SystemExit, match=r"not a class of this package: .* pass --trusted-targets collections$"):
        main([str(path), str(tmp_path / "out")])


def test_every_exported_file_has_the_mode_the_umask_gives(exports: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in exports.rglob("*") if path.is_file()}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes  # safetensors alone writes 0600


def test_weights_that_do_not_fit_the_stored_config_are_named(checkpoints: dict[str, Path]) -> None:
    checkpoint = load_checkpoint(checkpoints["clm_tiny"])
    partial = {name: tensor for name, tensor in checkpoint["state_dict"].items() if "final_norm" not in name}
    with pytest.raises(
        CheckpointError, match=r"the weights in old.ckpt do not fit the model its config builds .*Missing"
    ):
        stored_model({**checkpoint, "state_dict": partial}, "old.ckpt")


def test_a_failed_write_leaves_neither_the_export_nor_its_staging(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_directory(tmp_path / "out", {"a.json": b"{}", "sub/b.bin": b"x", "c.txt": b"y"})
    assert list(tmp_path.iterdir()) == []


def test_a_two_tower_contrastive_model_is_refused(tmp_path: Path, pair_dir: Path) -> None:
    train(compose_run(tmp_path, "contrastive_tiny", pair_dir, "model.shared_towers=false", "trainer.max_steps=3"))
    with pytest.raises(ConfigError, match=r"a tower per side \(model.shared_towers=false\)"):
        export(tmp_path / "checkpoints" / "last.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_causal_model_with_rotary_positions_has_no_gpt2_form() -> None:
    rotary = Transformer(vocab_size=320, d_model=32, n_layer=1, n_head=2, positions="rotary")
    fix = "cannot be exported as GPT-2: train it with model.backbone.positions=learned"
    with pytest.raises(
        ConfigError, match=f"GPT-2 has learned positions and this causal model has rotary ones, so it {fix}"
    ):
        gpt2_config(rotary)
    with pytest.raises(ConfigError, match=r"cannot be started from callbacks\.init_from_hf\.path=gpt2: train it with"):
        check_gpt2_fits(
            gpt2_config(Transformer(vocab_size=320, d_model=32, n_layer=1, n_head=2)),
            rotary,
            320,
            "callbacks.init_from_hf.path=gpt2",
        )
