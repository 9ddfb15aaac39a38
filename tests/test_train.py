"""End to end: train.py writes checkpoints and metrics that evaluate.py reproduces;
bad input stops before training with a message that names the fix."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from conftest import TINY_RUN
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR
from pretraining.errors import CheckpointError, ConfigError, ShardError
from pretraining.evaluate import evaluate
from pretraining.instantiate import build
from pretraining.objectives.causal_lm import CausalLM
from pretraining.run import build_trainer
from pretraining.stored import load_checkpoint
from pretraining.train import train


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as file:
        return list(csv.DictReader(file))


def test_train_then_evaluate_reproduces_validation_loss(compose_train, tmp_path: Path, shard_dir: Path) -> None:
    metrics = train(compose_train())
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt",
        "step-000006.ckpt",
        "step-000006.ckpt.json",
        "step-000012.ckpt",
        "step-000012.ckpt.json",
    ]
    assert (checkpoints / "last.ckpt").resolve() == checkpoints / "step-000012.ckpt"

    logged = metrics_rows_with(tmp_path, "val/loss")
    assert [int(row["step"]) for row in logged] == [0, 6, 12]  # before training, after steps 6 and 12
    assert float(logged[-1]["val/bpb"]) < float(logged[0]["val/bpb"])
    assert float(logged[-1]["val/loss"]) == pytest.approx(metrics["val/loss"], abs=1e-6)

    lineage = load_checkpoint(checkpoints / "last.ckpt")["lineage"]
    assert lineage["data_version"] == json.loads((shard_dir / "manifest.json").read_text())["version"]
    assert lineage["config"]["model"]["backbone"]["d_model"] == 32
    assert {"commit", "dirty"} <= set(lineage["code"])

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        eval_cfg = compose(
            "eval",
            overrides=[f"ckpt_path={checkpoints / 'last.ckpt'}", f"paths.output_dir={tmp_path}", "max_new_tokens=8"],
        )
    result = evaluate(eval_cfg)
    assert result["step"] == 12
    assert result["val/loss"] == pytest.approx(metrics["val/loss"], abs=1e-5)
    assert result["val/bpb"] == pytest.approx(metrics["val/bpb"], abs=1e-5)
    assert result["sample"].startswith("def ")
    assert (tmp_path / "metrics.json").is_file()


@pytest.mark.parametrize(
    ("experiment", "keys"),
    [
        ("mlm_tiny", ["val/loss", "val/accuracy"]),
        ("contrastive_tiny", ["val/loss", "val/q2p_mrr", "val/p2q_mrr", "val/q2p_recall@1", "val/p2q_recall@10"]),
    ],
)
def test_each_objective_trains_and_evaluate_reproduces_it(
    compose_train, tmp_path: Path, experiment: str, keys: list[str]
) -> None:
    metrics = train(compose_train(experiment=experiment))
    assert math.isfinite(metrics["train/loss"])
    logged = metrics_rows_with(tmp_path, "val/loss")
    assert [int(row["step"]) for row in logged] == [0, 6, 12]
    last = tmp_path / "checkpoints" / "last.ckpt"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        eval_cfg = compose("eval", overrides=[f"ckpt_path={last}", f"paths.output_dir={tmp_path}"])
    result = evaluate(eval_cfg)
    assert result["step"] == 12 and "sample" not in result
    for key in keys:
        assert result[key] == pytest.approx(metrics[key], abs=1e-5), key
        assert float(logged[-1][key]) == pytest.approx(metrics[key], abs=1e-6), key


def metrics_rows_with(run_dir: Path, key: str) -> list[dict[str, str]]:
    return [row for row in metric_rows(run_dir) if row.get(key)]


@pytest.mark.parametrize(
    "overrides",
    [["debug=fdr"], ["debug=limit"], ["debug=profiler"], ["debug=overfit", "trainer.max_steps=8"]],
    ids=lambda o: o[0],
)
def test_debug_presets_train(compose_train, overrides: list[str]) -> None:
    metrics = train(compose_train(*overrides))
    assert "train/loss" in metrics


@pytest.mark.slow  # two runs; tests/test_console.py's default run and tests/test_tracking.py stay in the fast suite
def test_cli_run_directory_checkpoint_csv_and_offline_wandb_continued_on_resume(
    tmp_path: Path, shard_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")} | {"WANDB_SILENT": "true"}
    overrides = [*TINY_RUN, "logger=default", f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}", "run_name=cli"]

    def pretrain(*more: str) -> str:
        command = [str(Path(sys.executable).parent / "pretrain"), *overrides, *more]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    output = pretrain("trainer.max_steps=6", "trainer.log_every_n_steps=2")
    run_dir = tmp_path / "train" / "runs" / "cli"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert metrics_rows_with(run_dir, "train/loss")
    run_id = (run_dir / "wandb_run_id").read_text()
    assert (
        f"wandb sync {run_dir}/wandb/offline-run-*-{run_id}" in output
    )  # every start of the run, as the shell expands it

    output = pretrain("trainer.max_steps=12", "trainer.log_every_n_steps=2")  # continued: the same W&B run id
    assert f"wandb sync {run_dir}/wandb/offline-run-*-{run_id}" in output
    offline_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in offline_runs)
    lineage = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["lineage"]
    assert lineage["wandb_run_id"] == run_id and lineage["step"] == 12
    assert lineage["parent"] == str(run_dir / "checkpoints" / "step-000006.ckpt")


def test_final_step_is_validated_when_off_the_interval(compose_train, tmp_path: Path) -> None:
    metrics = train(compose_train("trainer.max_steps=8"))
    steps = [int(row["step"]) for row in metrics_rows_with(tmp_path, "val/loss")]
    assert steps == [0, 6, 8]  # before training, after step 6, and the final weights after step 8
    assert "val/bpb" in metrics and "step" not in metrics  # `step` only places the validation rows


def test_missing_manifest_stops_before_training(compose_train, tmp_path: Path) -> None:
    empty = tmp_path / "no-shards"
    empty.mkdir()
    with pytest.raises(ShardError, match="pretrain-data build"):
        train(compose_train(f"data.dir={empty}"))


def test_block_size_above_max_positions_stops(compose_train, tmp_path: Path) -> None:
    message = r"data\.format\.block_size=128 exceeds model\.backbone\.max_seq_len=64: lower data\.format\.block_size"
    with pytest.raises(ConfigError, match=message):
        train(compose_train("data.format.block_size=128"))
    # before the shards are read (their checksums can take minutes): here there are none
    with pytest.raises(ConfigError, match=message):
        train(compose_train("data.format.block_size=128", f"data.dir={tmp_path / 'nowhere'}"))


def test_a_warmup_longer_than_the_run_is_shortened_to_a_tenth_of_it(
    compose_train, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train(compose_train("model.warmup_steps=50", "trainer.max_steps=20", "trainer.log_every_n_steps=1"))
    assert "model.warmup_steps=50 is not below trainer.max_steps=20: warming up for 2 steps" in caplog.text
    lineage = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["lineage"]
    assert lineage["config"]["model"]["warmup_steps"] == 2  # what the run used
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    rates = [float(row["lr-AdamW/pg1"]) for row in rows if row.get("lr-AdamW/pg1")]
    assert rates[0] < max(rates) and rates[-1] < max(rates)  # up, then down: a schedule, not a ramp


def test_evaluate_refuses_a_checkpoint_of_another_lineage_format(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    path = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["lineage"]["format"] = 1
    torch.save(checkpoint, tmp_path / "old.ckpt")  # a checkpoint copied without its sidecar still loads
    with pytest.raises(ConfigError, match=r"lineage format 1, this code reads \(4,\): evaluate it with the code"):
        load_checkpoint(tmp_path / "old.ckpt")
    torch.save(checkpoint, path)  # one that no longer matches its sidecar does not
    with pytest.raises(CheckpointError, match=r"its sidecar says \d+: it is truncated or altered"):
        load_checkpoint(path)


def test_evaluate_missing_checkpoint(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=[f"ckpt_path={tmp_path}/nope.ckpt", f"paths.output_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=r"nope\.ckpt not found"):
        evaluate(cfg)


class CausalLMWithZLoss(CausalLM):
    """An objective from outside the package: next-token loss plus PaLM's z-loss on the log-normaliser, a
    training value of its own. It overrides Lightning's training hooks as any LightningModule may, without
    `super()`: the training values are logged all the same."""

    def __init__(self, *args, z_loss: float = 1e-4, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.z_loss = z_loss

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["tokens"][:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten())
        z_loss = logits.logsumexp(-1).pow(2).mean()
        self.step_values["train/z_loss"] = z_loss.detach()
        return loss + self.z_loss * z_loss

    def on_train_start(self) -> None: ...

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...


def test_an_objective_from_outside_the_package_needs_only_its_target(compose_train, tmp_path: Path) -> None:
    cfg = compose_train("model._target_=test_train.CausalLMWithZLoss", "+model.z_loss=0.01")
    metrics = train(cfg)
    assert "val/bpb" in metrics and metrics["train/z_loss"] > 0
    logged = [row for row in metric_rows(tmp_path) if row.get("train/loss")]
    assert logged and all(float(row["train/z_loss"]) > 0 for row in logged)
    lineage = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["lineage"]
    assert lineage["config"]["model"]["_target_"] == "test_train.CausalLMWithZLoss"


def test_info_prints_a_resumed_checkpoints_lineage_and_ancestry(
    compose_train, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    train(compose_train("trainer.max_steps=6"))
    train(compose_train("trainer.max_steps=12"))  # continues the run from step 6
    checkpoints = tmp_path / "checkpoints"
    capsys.readouterr()  # the training runs' output
    info_main([str(checkpoints / "last.ckpt"), "--json"])
    chain = json.loads(capsys.readouterr().out)
    assert [entry["lineage"]["step"] for entry in chain] == [12, 6]
    assert chain[0]["lineage"]["parent"] == chain[1]["path"] == str(checkpoints / "step-000006.ckpt")
    assert [entry["verified"] for entry in chain] == ["ok", "ok"]

    info_main([str(checkpoints / "step-000012.ckpt"), "--config"])
    printed = capsys.readouterr().out
    assert "continued from  " + str(checkpoints / "step-000006.ckpt") + " (step 6, verified: ok)" in printed
    assert "\nconfig:\n" in printed and "max_steps: 12" in printed

    (checkpoints / "step-000006.ckpt").unlink()
    info_main([str(checkpoints / "step-000012.ckpt")])
    assert f"{checkpoints / 'step-000006.ckpt'} (no longer exists)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not found"):
        info_main([str(checkpoints / "step-000099.ckpt")])


@pytest.mark.parametrize(("trainer", "world", "accumulation"), [("cpu", 1, 4), ("ddp_cpu", 2, 2)])
def test_the_trainer_accumulates_the_global_batch_over_its_processes(
    compose_train: Any, trainer: str, world: int, accumulation: int
) -> None:
    """A global batch of 4 in micro-batches of 1: 4 per step on one process, 2 on each of two; the validation
    interval (6 steps) in Lightning's micro-batches. Nothing is launched: the Trainer is only built."""
    cfg = compose_train(f"trainer={trainer}", "data.micro_batch_size=1", "data.streams=4", "logger=csv")
    datamodule = build(cfg.data, tokenizer=build(cfg.tokenizer))
    built = build_trainer(cfg, datamodule, callbacks=[])
    assert (built.world_size, built.accumulate_grad_batches) == (world, accumulation)
    assert built.val_check_interval == 6 * accumulation
