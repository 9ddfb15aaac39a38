"""scripts/bench/bench_evals.py scores a checkpoint and its untrained start as the callback scored them in the loop:
its untrained row is the run's step-0 evaluation (the stored config built again after the run's seed), its trained
row the last step's, each inside its bootstrap interval."""

from __future__ import annotations

import csv
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from pretraining.config import PROJECT_ROOT
from pretraining.extras.evals.build import build_suite
from pretraining.train import train


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_evals", PROJECT_ROOT / "scripts" / "bench" / "bench_evals.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (PROJECT_ROOT / "scripts" / "bench").is_dir(), reason="the bench extra is not in this checkout")
def test_the_untrained_and_trained_rows_are_the_runs_step_0_and_last_evaluations(
    compose_train, tmp_path: Path, shard_dir: Path, pair_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    suite = tmp_path / "suite"
    build_suite(shard_dir, pair_dir, suite, items=8)
    run = ["trainer.max_steps=4", "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_steps=4"]
    run += ["model.backbone.max_seq_len=320", "callbacks=[default,evals]", f"callbacks.evals.suite={suite}"]
    train(compose_train(*run, "callbacks.evals.limit=8", "seed=7"))
    with (tmp_path / "csv" / "metrics.csv").open() as file:
        logged = {int(row["step"]): row for row in csv.DictReader(file) if row.get("eval/stdlib_next_line/acc")}
    assert sorted(logged) == [0, 4]

    script = load_script()
    script.main([str(tmp_path / "checkpoints" / "last.ckpt"), "--suite", str(suite), "--limit", "8"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| clm_tiny")]
    assert {(row[1], row[3]) for row in rows} == {
        (task, metric) for task in ("stdlib_next_line", "stdlib_function_name") for metric in ("acc", "acc_norm")
    }
    for _, task, items, metric, _, untrained, trained in (row[:7] for row in rows):
        assert items == "8"
        for step, shown in ((0, untrained), (4, trained)):
            value, low, high = map(float, re.fullmatch(r"(\S+) \((\S+) to (\S+)\)", shown.strip(" |")).groups())
            assert value == pytest.approx(float(logged[step][f"eval/{task}/{metric}"]), abs=5e-4), (task, step)
            assert low <= value <= high
