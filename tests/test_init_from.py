"""`callbacks.init_from`: a fresh run starts from another run's checkpoint (a second stage). The backbone arrives
bit for bit, a same-objective parent gives its whole model, every mismatch stops the run before any step in one
line naming the key, a resumed run keeps its weights and its recorded parent, and `pretrain-info` shows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from conftest import CONFIG_DIR, tiny_run
from pretraining.cli import info as info_main
from pretraining.errors import ConfigError, MissingFileError
from pretraining.stored import load_checkpoint
from pretraining.train import train

# A step at a learning rate of 1e-30 changes no float32 weight: the checkpoint holds what the run started from.
CHILD = ["model/backbone=transformer"]  # mlm_tiny with clm_tiny's backbone (learned positions): the parent's shapes


def compose_run(root: Path, experiment: str, data_dir: Path, *overrides: str) -> DictConfig:
    base = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={data_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=[*base, *tiny_run(experiment), "trainer.max_steps=4", *overrides])


def init_from(path: Path, *settings: str) -> list[str]:
    return ["callbacks=[default,init_from]", f"callbacks.init_from.path={path}", *settings]


@pytest.fixture(scope="module")
def parent_run(tmp_path_factory: pytest.TempPathFactory, shard_dir: Path) -> Path:
    """A four-step next-token run (clm_tiny's backbone)."""
    root = tmp_path_factory.mktemp("parent")
    train(compose_run(root, "clm_tiny", shard_dir))
    return root


def backbone_weights(path: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(path)["state_dict"]
    return {name: tensor for name, tensor in state.items() if name.startswith("backbone.")}


def test_a_masked_lm_starts_from_a_next_token_runs_backbone(
    parent_run: Path, tmp_path: Path, shard_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    child = tmp_path / "child"
    train(
        compose_run(
            child,
            "mlm_tiny",
            shard_dir,
            *CHILD,
            *init_from(parent_run),
            "trainer.max_steps=1",
            "model.optimizer.lr=1e-30",
        )
    )
    last = child / "checkpoints" / "last.ckpt"
    parent_last = (parent_run / "checkpoints" / "last.ckpt").resolve()
    theirs, ours = backbone_weights(parent_last), backbone_weights(last)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[name], ours[name]) for name in theirs)
    origin = load_checkpoint(last)["lineage"]["origin"]
    assert origin["init_from"] == str(parent_last) and origin["step"] == 4 and origin["objective"] == "CausalLM"
    assert origin["loaded"] == "the backbone" and len(origin["checkpoint_sha256"]) == 64
    capsys.readouterr()
    info_main([str(last)])
    assert re.search(rf"\norigin +{re.escape(str(parent_last))} \(the backbone of run ", capsys.readouterr().out)
    # Continued: the same parent is accepted, another is refused naming the one it started from.
    train(compose_run(child, "mlm_tiny", shard_dir, *CHILD, *init_from(parent_run), "trainer.max_steps=2"))
    assert load_checkpoint(last)["global_step"] == 2
    with pytest.raises(ConfigError, match=r"applies to a fresh run, and this one continues from .* started from"):
        train(compose_run(child, "mlm_tiny", shard_dir, *CHILD, *init_from(parent_last.parent), "trainer.max_steps=3"))
    # Continued without the callback: every later checkpoint still names where the weights came from.
    train(compose_run(child, "mlm_tiny", shard_dir, *CHILD, "trainer.max_steps=3"))
    assert load_checkpoint(last)["global_step"] == 3 and load_checkpoint(last)["lineage"]["origin"] == origin


def test_a_same_objective_parent_gives_its_whole_model(parent_run: Path, tmp_path: Path, shard_dir: Path) -> None:
    parent_last = (parent_run / "checkpoints" / "last.ckpt").resolve()
    train(
        compose_run(
            tmp_path,
            "clm_tiny",
            shard_dir,
            *init_from(parent_last),
            "trainer.max_steps=1",
            "model.optimizer.lr=1e-30",
            "model.optimizer.weight_decay=0",
        )
    )
    child = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert child["lineage"]["origin"]["loaded"] == "the whole model"
    theirs, ours = load_checkpoint(parent_last)["state_dict"], child["state_dict"]
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[name], ours[name]) for name in theirs)


def test_contrastive_towers_start_from_a_backbone_each_tower_from_its_own(
    parent_run: Path, tmp_path: Path, shard_dir: Path, pair_dir: Path
) -> None:
    """Next-token into both towers of a two-tower model; that model (one step on: its towers differ) into another
    of other heads, each tower from its own (not the whole model: the heads' shapes differ)."""
    pairs = ["tokenizer=bytes", "model.shared_towers=false", "model.optimizer.weight_decay=0"]
    child, grandchild = tmp_path / "child", tmp_path / "grandchild"
    train(compose_run(child, "contrastive_tiny", pair_dir, *pairs, *init_from(parent_run), "trainer.max_steps=1"))
    tuned = load_checkpoint(child / "checkpoints" / "last.ckpt")
    assert tuned["lineage"]["origin"]["loaded"] == "the backbone, into both towers"
    frozen = ["trainer.max_steps=1", "model.optimizer.lr=1e-30", "model.embed_dim=16"]
    train(compose_run(grandchild, "contrastive_tiny", pair_dir, *pairs, *init_from(child), *frozen))
    state = load_checkpoint(grandchild / "checkpoints" / "last.ckpt")["state_dict"]
    for tower in ("backbone.", "passage_backbone."):
        names = [name for name in state if name.startswith(tower)]
        assert names and all(torch.equal(state[name], tuned["state_dict"][name]) for name in names)
    assert not torch.equal(
        tuned["state_dict"]["backbone.blocks.0.mlp.up.weight"], state["passage_backbone.blocks.0.mlp.up.weight"]
    )


def refused(cfg: DictConfig, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        train(cfg)
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.backbone.d_model=64"], r"32 width and this run's has 64: set model.backbone.d_model"),
        (["model.backbone.n_layer=2"], r"1 layers and this run's has 2: set model.backbone.n_layer"),
        (["model.backbone.max_seq_len=32"], r"64 positions and this run's has 32: set model.backbone.max_seq_len"),
        (["model/backbone=llama"], r"has a Transformer backbone and this run a Llama"),
        (["model.backbone.bias=true"], r"tensor blocks.0.attention.proj.bias is missing there and \(32,\) in this run"),
        (["callbacks.init_from.towers=query"], r"towers=query chooses a tower of a two-tower run"),
        (["model.backbone.activation=gelu_tanh"], r"model.backbone.activation=gelu and this run's is gelu_tanh: set"),
    ],
)
def test_a_parent_that_does_not_fit_is_refused_before_any_step(
    parent_run: Path, tmp_path: Path, shard_dir: Path, overrides: list[str], message: str
) -> None:
    refused(
        compose_run(tmp_path, "mlm_tiny", shard_dir, *CHILD, *init_from(parent_run), *overrides), ConfigError, message
    )


def test_another_tokenizer_or_no_checkpoint_is_refused(
    parent_run: Path, tmp_path: Path, shard_dir: Path, bpe_path: Path
) -> None:
    bpe = ["tokenizer=bpe", f"tokenizer.path={bpe_path}"]
    cfg = compose_run(tmp_path / "bpe", "mlm_tiny", shard_dir, *CHILD, *bpe, *init_from(parent_run))
    refused(cfg, ConfigError, r"was trained with another tokenizer \(fingerprint .*\): its weights read other ids")
    cfg = compose_run(tmp_path / "gone", "mlm_tiny", shard_dir, *CHILD, *init_from(tmp_path / "nothing"))
    refused(cfg, MissingFileError, r"no such checkpoint or run")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    cfg = compose_run(tmp_path / "none", "mlm_tiny", shard_dir, *CHILD, *init_from(tmp_path / "empty"))
    refused(cfg, MissingFileError, r"the run has no checkpoint that verifies")


def test_a_start_that_is_not_there_moves_no_earlier_run_aside(tmp_path: Path, shard_dir: Path) -> None:
    earlier = tmp_path / "run" / "checkpoints"
    earlier.mkdir(parents=True)
    cfg = compose_run(tmp_path / "run", "mlm_tiny", shard_dir, *CHILD, *init_from(tmp_path / "typo"), "resume=never")
    with pytest.raises(MissingFileError, match=r"callbacks.init_from.path=.*typo: no such checkpoint, run or model"):
        train(cfg)
    assert earlier.is_dir()
    both = ["callbacks=[default,init_from,init_from_hf]", f"callbacks.init_from.path={tmp_path}"]
    with pytest.raises(ConfigError, match=r"callbacks.init_from and callbacks.init_from_hf are two starting points"):
        train(compose_run(tmp_path / "run", "mlm_tiny", shard_dir, *both, f"callbacks.init_from_hf.path={tmp_path}"))


def test_a_checkpoint_directory_is_its_run_and_a_model_directory_is_named(
    parent_run: Path, tmp_path: Path, shard_dir: Path
) -> None:
    train(compose_run(tmp_path / "child", "mlm_tiny", shard_dir, *CHILD, *init_from(parent_run / "checkpoints")))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    cfg = compose_run(tmp_path / "other", "mlm_tiny", shard_dir, *CHILD, *init_from(tmp_path / "hf"))
    refused(cfg, ConfigError, r"is a Hugging Face model directory: start from it with callbacks.init_from_hf")
