"""What a user adds the Lightning way resumes as if the run had never stopped: Lightning's own `EarlyStopping` and
`ModelCheckpoint`, added from the command line, kept by real `pretrain` processes killed and run again."""

from __future__ import annotations

import csv
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import tiny_run
from pretraining.checkpoint import saved_checkpoints
from test_resume import TEST_ENV, pretrain, pretrain_command, run_dir

# Validations every 6 steps; EarlyStopping stops at the third (18): two without an improvement of 100.
# ModelCheckpoint keeps the best one of them (val/loss falls: the newest).
LIGHTNINGS_OWN = [
    "trainer.max_steps=30",
    "+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.early_stop.monitor=val/loss",
    "+callbacks.early_stop.patience=2",
    "+callbacks.early_stop.min_delta=100",
    "+callbacks.best._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "+callbacks.best.dirpath=${paths.output_dir}/best",
    "+callbacks.best.filename='best-{step}'",
    "+callbacks.best.monitor=val/loss",
    "+callbacks.best.save_top_k=1",
]


def validated_steps(log_dir: Path, run: str) -> list[int]:
    with (run_dir(log_dir, run) / "csv" / "metrics.csv").open() as file:
        return [int(row["step"]) for row in csv.DictReader(file) if row.get("val/loss")]


def best_files(log_dir: Path, run: str) -> list[str]:
    return sorted(path.name for path in (run_dir(log_dir, run) / "best").glob("*.ckpt"))


@pytest.mark.slow  # four tiny runs
def test_lightnings_early_stopping_and_model_checkpoint_resume_as_if_never_interrupted(
    tmp_path: Path, small_shards: Path
) -> None:
    overrides = [*tiny_run("clm_tiny"), f"data.dir={small_shards}", *LIGHTNINGS_OWN]
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert best_files(tmp_path, "reference") == ["best-step=18.ckpt"]
    assert pretrain(tmp_path, "killed", overrides, kill_after=14) == -signal.SIGKILL  # after step 12's validation
    assert [step for step, _ in saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")] == [12, 6]
    assert pretrain(tmp_path, "killed", overrides) == 0
    # Saved after its validation, step 12's checkpoint holds both callbacks' state after it: one best file
    # (not step 12's left behind), and the stop at the same validation (not one interval later).
    assert best_files(tmp_path, "killed") == best_files(tmp_path, "reference")
    steps = [step for step, _ in saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")]
    assert steps[0] == 18 and validated_steps(tmp_path, "killed") == validated_steps(tmp_path, "reference")

    # The stopped run, run again, stays stopped: no step trained, no validation, its result returned.
    again = subprocess.run(
        pretrain_command(tmp_path, "killed", overrides), env=TEST_ENV, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "EarlyStopping stopped this run at step 18" in again.stdout + again.stderr
    assert saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")[0][0] == 18
    assert validated_steps(tmp_path, "killed") == validated_steps(tmp_path, "reference")
