"""A default run prints the template's own lines and the progress bar: no dependency's tip, device line,
deprecation, banner or second summary (`pretraining.quiet`); `quiet=false` shows them again."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY
from pretraining.cli import data
from pretraining.report import has_extra

# What the libraries print in a run when nothing quiets them (issue 21's list, and the run's log file).
NOISE = [
    "💡 Tip",  # Lightning: install litlogger
    "LeafSpec",  # torch's deprecation, raised in Lightning's _pytree
    "The anonymous setting has no effect",  # W&B, for the argument Lightning always passes
    "GPU available:",
    "TPU available:",
    "Total FLOPs",  # Lightning's model summary
    "Validate metric",  # Lightning's validation tables, a second final summary
    "Run summary:",  # W&B's footer, a third
    "Tracking run with wandb",  # W&B's banner
    "Seed set to",
    "`Trainer.fit` stopped",
    "Restoring states from the checkpoint",  # Lightning, on a resume (the run's own line says it)
    "INFO: ",  # a message printed a second time by the `lightning` package's own handler
]


def run(command: list[str]) -> str:
    """Everything `command` printed (W&B offline and not silenced by the test environment)."""
    env = {key: value for key, value in os.environ.items() if key != "WANDB_SILENT"} | {"WANDB_MODE": "offline"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def pretrain(tmp_path: Path, shard_dir: Path, *overrides: str) -> str:
    """A short run of the default preset (W&B and CSV loggers, probe off: the test shards hold little
    Python), with the default warmup; everything it printed."""
    tiny = [o for o in TINY if not o.startswith(("logger=", "model.warmup_steps=", "trainer.max_steps="))]
    program = str(Path(sys.executable).parent / "pretrain")
    return run(
        [program, "experiment=clm_tiny", *tiny, f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}", *overrides]
    )


def test_a_default_run_prints_only_its_own_lines(tmp_path: Path, shard_dir: Path) -> None:
    printed = pretrain(tmp_path, shard_dir, "trainer.max_steps=6", "run_name=quiet")
    assert [noise for noise in NOISE if noise in printed] == []
    run_dir = tmp_path / "train" / "runs" / "quiet"
    assert "model.warmup_steps=30 is not below trainer.max_steps=6: no warmup instead" in printed
    assert printed.count("run directory:") == 1  # once, not again through a second handler
    for command in (f"pretrain-info {run_dir}/checkpoints/", "with: wandb sync"):
        assert command in printed
    assert (f"pretrain-plot {run_dir}" in printed) == has_extra("plots")
    assert not [noise for noise in NOISE if noise in (run_dir / "train.log").read_text()]
    (evaluate,) = [line.split(":", 1)[1] for line in printed.splitlines() if line.startswith("  evaluate it:")]
    # The printed command runs as printed (its outputs kept out of the repository's logs/).
    assert "val/loss:" in run([*shlex.split(evaluate), f"paths.log_dir={tmp_path}"])


@pytest.mark.slow  # two runs; a first run's output is checked in the fast suite
def test_a_resumed_run_prints_only_its_own_lines(tmp_path: Path, shard_dir: Path) -> None:
    pretrain(tmp_path, shard_dir, "trainer.max_steps=6", "run_name=quiet")
    resumed = pretrain(tmp_path, shard_dir, "trainer.max_steps=8", "run_name=quiet")
    assert [noise for noise in NOISE if noise in resumed] == [] and "resuming from" in resumed


@pytest.mark.slow  # a run of its own; the quiet default run stays in the fast suite
def test_quiet_false_shows_the_libraries_messages(tmp_path: Path, shard_dir: Path) -> None:
    printed = pretrain(tmp_path, shard_dir, "quiet=false")
    assert "GPU available:" in printed and "Tracking run with wandb" in printed and "Seed set to" in printed


def test_training_a_tokenizer_off_a_terminal_prints_no_blank_lines(
    tmp_path: Path, shard_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data(["tokenizer", "--data", str(shard_dir), "--vocab-size", "300", "--out", str(tmp_path / "t.json")])
    printed = capfd.readouterr()  # what reached the file descriptors: the tokenizers library writes there
    assert printed.out.splitlines() == [printed.out.strip()] and printed.out.startswith("wrote ")
    assert printed.err == ""
