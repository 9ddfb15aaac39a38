"""A signal in any phase of a run ends it within seconds with nothing lost, and the same command
continues exactly: bitwise the same batches, losses and weights as an uninterrupted run, and the
same learning curve (no validation missing, none twice)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_run
from test_resume import DDP, RESUMABLE, TESTS, assert_same_training, pretrain, run_dir

PHASES = [
    "setup",
    "validation_before_training",
    "save",
    "validation_in_training",
    "training",
    "final_validation",
    "report",
]
# Validation after steps 4 and 8 and after the last, 10; checkpoints at 4, 8 and 10.
OVERRIDES = [*RESUMABLE, "trainer.max_steps=10", "trainer.val_check_interval=4", "data.micro_batch_size=null"]


def run_until_signalled(log_dir: Path, run: str, overrides: list[str]) -> tuple[int, float, str]:
    """Run `pretrain` once: its exit status, the time it ended, and its output."""
    command = [sys.executable, "-m", "pretraining.train", *overrides, f"paths.log_dir={log_dir}", f"run_name={run}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    return process.returncode, time.time(), process.stdout + process.stderr


def validation_rows(log_dir: Path, run: str) -> list[tuple[str, str]]:
    with (run_dir(log_dir, run) / "csv" / "metrics.csv").open() as file:
        return [(row["step"], row["val/loss"]) for row in csv.DictReader(file) if row.get("val/loss")]


def test_a_sigterm_in_every_phase_ends_the_run_and_it_continues_exactly(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *OVERRIDES, f"data.dir={shard_dir}"]
    markers = tmp_path / "signalled"
    signalled = [
        *overrides,
        "+callbacks.signal._target_=kill.SignalInEveryPhase",
        f"+callbacks.signal.markers={markers}",
        "+callbacks.signal.max_steps=10",
    ]
    for phase in PHASES:
        status, ended, output = run_until_signalled(tmp_path, "signalled", signalled)
        assert (markers / phase).exists(), f"no signal in {phase}; the run ended with {status}:\n{output[-3000:]}"
        # Killed by the signal's default action where nothing runs yet (or any more), else stopped by us.
        assert status in (-signal.SIGTERM, 128 + signal.SIGTERM), f"{phase}: exit {status}\n{output[-3000:]}"
        assert ended - float((markers / phase).read_text()) < 10, phase
        assert "Traceback" not in output, output[-3000:]
    # The finished run, again: nothing runs (no validation row twice, no logger, so no second W&B run).
    status, _, output = run_until_signalled(tmp_path, "signalled", signalled)
    assert status == 0 and "the run is complete" in output and "Validation" not in output, output[-3000:]
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "signalled", 10)
    assert validation_rows(tmp_path, "signalled") == validation_rows(tmp_path, "reference")
    assert len(validation_rows(tmp_path, "reference")) == 4  # before training, after steps 4, 8 and 10


@pytest.mark.slow  # about a minute: two processes per run
def test_a_sigterm_to_one_rank_in_training_or_validation_stops_every_rank(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *OVERRIDES, *DDP, f"data.dir={shard_dir}"]
    markers = tmp_path / "signalled"
    signalled = [
        *overrides,
        "+callbacks.signal._target_=kill.SignalInEveryPhase",
        f"+callbacks.signal.markers={markers}",
        "+callbacks.signal.max_steps=10",
        "+callbacks.signal.phases=[validation_in_training,training]",
        "+callbacks.signal.rank=1",
    ]
    for phase in ("validation_in_training", "training"):
        status, ended, output = run_until_signalled(tmp_path, "signalled", signalled)
        assert (markers / phase).exists(), f"no signal in {phase}; the run ended with {status}:\n{output[-3000:]}"
        assert status == 128 + signal.SIGTERM, f"{phase}: exit {status}\n{output[-3000:]}"
        assert ended - float((markers / phase).read_text()) < 10, phase
    assert run_until_signalled(tmp_path, "signalled", signalled)[0] == 0
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "signalled", 10)
    assert validation_rows(tmp_path, "signalled") == validation_rows(tmp_path, "reference")
