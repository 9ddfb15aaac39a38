"""scripts/schedule.sh: a run, the same run continued longer, its evaluation and lineage, then
another objective; the first failing step stops the schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY
from pretraining.config import PROJECT_ROOT
from pretraining.info import ancestry

SCRIPT = PROJECT_ROOT / "scripts" / "schedule.sh"
BIN = Path(sys.executable).parent  # the environment's pretrain console scripts


def schedule(overrides: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    variables = os.environ | {"PYTHONPATH": str(PROJECT_ROOT / "src"), "BIN": str(BIN), **env}
    return subprocess.run([SCRIPT, *overrides], env=variables, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # 30 s; the next test checks the chain with stand-in commands in the default suite
def test_schedule_continues_the_run_then_evaluates_it(small_shards: Path, tmp_path: Path) -> None:
    tiny = [override for override in TINY if not override.startswith("trainer.max_steps=")]  # the schedule sets it
    steps = {"SHORT_STEPS": "6", "LONG_STEPS": "12", "THEN": ""}  # no step (d): test_schedule_steps covers it
    result = schedule([f"data.dir={small_shards}", *tiny], LOG_DIR=str(tmp_path), RUN="short", **steps)
    assert result.returncode == 0, result.stderr[-3000:]

    checkpoints = tmp_path / "train" / "runs" / "short" / "checkpoints"
    chain = ancestry(checkpoints / "last.ckpt")  # what `pretrain-info --json` prints
    assert [entry["lineage"]["step"] for entry in chain] == [12, 6]  # continued from the short run's last step
    assert chain[0]["lineage"]["parent"] == str(checkpoints / "step-000006.ckpt")
    assert chain[0]["lineage"]["config"]["trainer"]["max_steps"] == 12
    assert "\nstep: 12\n" in result.stdout and "\nval/bpb: " in result.stdout  # pretrain-eval's metrics
    assert f"continued from  {checkpoints / 'step-000006.ckpt'} (step 6, verified: ok)" in result.stdout
    assert sorted(path.name for path in (tmp_path / "train" / "runs").iterdir()) == ["short"]


def test_schedule_steps_and_stop_at_the_first_failure(tmp_path: Path) -> None:
    """With stand-ins for the console scripts, which record their arguments: the commands in order,
    and nothing after a step that fails."""
    for name in ("pretrain", "pretrain-eval", "pretrain-info"):
        stand_in = tmp_path / name
        stand_in.write_text(f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n[ "{name}" != "$FAIL" ]\n')
        stand_in.chmod(0o755)
    calls, logs = tmp_path / "calls.txt", tmp_path / "logs"
    env = {"BIN": str(tmp_path), "CALLS": str(calls), "LOG_DIR": str(logs), "RUN": "r", "FAIL": ""}
    last = f"{logs}/train/runs/r/checkpoints/last.ckpt"
    common = f"paths.log_dir={logs} seed=1"

    assert schedule(["seed=1"], **env).returncode == 0
    assert calls.read_text().splitlines() == [
        f"pretrain experiment=clm_tiny run_name=r trainer.max_steps=300 {common}",
        f"pretrain experiment=clm_tiny run_name=r trainer.max_steps=600 {common}",
        f"pretrain-eval ckpt_path={last} paths.log_dir={logs}",
        f"pretrain-info {last}",
        f"pretrain experiment=mlm_tiny run_name=r-mlm_tiny trainer.max_steps=600 {common}",
    ]

    calls.unlink()
    failed = schedule(["seed=1"], **(env | {"FAIL": "pretrain-eval"}))
    assert failed.returncode != 0
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["pretrain", "pretrain", "pretrain-eval"]
