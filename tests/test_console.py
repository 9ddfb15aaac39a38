"""A default run prints the template's own lines and the progress bar, and nothing else (an allow-list): no
dependency's tip, device line, deprecation, hint, banner or second summary (`pretraining.quiet`), also on a
SLURM login node; `quiet=false` shows them again."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.plugins.environments import SLURMEnvironment

from conftest import TINY
from pretraining.callbacks.progress import ProgressBar
from pretraining.cli import data
from pretraining.quiet import quiet_libraries
from pretraining.report import has_extra

# The template's own lines in a run (`pretraining.run`, `resume`, `report`, the data's): every line a default
# run prints matches one of these, or is the progress bar's or the text sample's, so that any other line (a
# new warning, a tip, a banner, a message printed twice) fails the test.
OWN_LINES = [
    r"model\.warmup_steps=\d+ is not below trainer\.max_steps=\d+: .* set model\.warmup_steps to choose$",
    r"model\.decay_steps=\d+ does not fit in trainer\.max_steps=\d+ .* set model\.decay_steps to choose$",
    r"model: \w+, [\d.]+M parameters \(.*\)$",
    r"global batch \d+ = \d+ devices x \d+ micro-batches of \d+, drawn from \d+ streams$",
    r"validation: [\d,]+ blocks from [\d,]+ bytes of text of [\d,]+ of the [\d,]+ documents of the validation split",
    r"resuming from \S+",
    r"run directory: \S+$",
    r"last checkpoint: \S+$",
    r"  (evaluate it|what made it|export it): +\S+",
    r"learning curves: \S+",
    r"[\w/.-]+ = (-?[\d.]+(e[-+]?\d+)?|nan|inf)$",  # the final metrics
    r"W&B logged offline \(no credentials, or WANDB_MODE=offline\); upload the run with: wandb sync \S+$",
]
PROGRESS_BAR = r"(Sanity Checking|Validation|Training|Epoch \d+)( DataLoader \d+)?: +(\d+%)?\|"
TEXT_SAMPLE = re.compile(r"^Sample at step \d+:\n(-{60})\n.*?\n\1$", re.MULTILINE | re.DOTALL)
LOG_FILE_PREFIX = re.compile(r"^\[[^]]*\]\[[^]]*\]\[[A-Z]+\] - ", re.MULTILINE)  # configs/hydra/default.yaml


def foreign_lines(printed: str) -> list[str]:
    """The lines of `printed` that are neither the template's own, nor the progress bar's, nor the sample's."""
    lines = re.split(r"[\r\n]", TEXT_SAMPLE.sub("", printed.replace("\x1b[A", "")))
    allowed = re.compile("|".join(f"(?:{pattern})" for pattern in [*OWN_LINES, PROGRESS_BAR]))
    return [line for line in lines if line.strip() and not allowed.match(line)]


def fake_srun(directory: Path) -> dict[str, str]:
    """The environment of a SLURM login node: an `srun` on PATH, and this process no SLURM task."""
    srun = directory / "srun"
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def run(command: list[str], **environment: str) -> str:
    """Everything `command` printed (W&B offline and not silenced by the test environment)."""
    env = {key: value for key, value in os.environ.items() if key != "WANDB_SILENT" and not key.startswith("SLURM_")}
    env |= {"WANDB_MODE": "offline", **environment}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def pretrain(tmp_path: Path, shard_dir: Path, *overrides: str, experiment: str = "clm_tiny") -> str:
    """A short run of a preset (W&B and CSV loggers, probe off: the test shards hold little Python), with the
    default warmup, on a SLURM login node; everything it printed."""
    tiny = [o for o in TINY if not o.startswith(("logger=", "model.warmup_steps=", "trainer.max_steps="))]
    program = str(Path(sys.executable).parent / "pretrain")
    command = [program, f"experiment={experiment}", *tiny, f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}"]
    return run([*command, *overrides], **fake_srun(tmp_path))


def test_a_default_run_prints_only_its_own_lines(tmp_path: Path, shard_dir: Path) -> None:
    printed = pretrain(tmp_path, shard_dir, "trainer.max_steps=6", "run_name=quiet")
    assert foreign_lines(printed) == []
    run_dir = tmp_path / "train" / "runs" / "quiet"
    assert "model.warmup_steps=30 is not below trainer.max_steps=6: no warmup instead" in printed
    assert printed.count("run directory:") == 1  # once, not again through a second handler
    for command in (f"pretrain-info {run_dir}/checkpoints/", "with: wandb sync"):
        assert command in printed
    assert (f"pretrain-plot {run_dir}" in printed) == has_extra("plots")
    assert foreign_lines(LOG_FILE_PREFIX.sub("", (run_dir / "train.log").read_text())) == []
    (evaluate,) = [line.split(":", 1)[1] for line in printed.splitlines() if line.startswith("  evaluate it:")]
    # The printed command runs as printed (its outputs kept out of the repository's logs/).
    assert "val/loss:" in run([*shlex.split(evaluate), f"paths.log_dir={tmp_path}"])


@pytest.mark.slow  # two runs; a first run's output is checked in the fast suite
def test_a_resumed_run_prints_only_its_own_lines(tmp_path: Path, shard_dir: Path) -> None:
    pretrain(tmp_path, shard_dir, "trainer.max_steps=6", "run_name=quiet")
    resumed = pretrain(tmp_path, shard_dir, "trainer.max_steps=8", "run_name=quiet")
    assert foreign_lines(resumed) == [] and "resuming from" in resumed


@pytest.mark.slow  # a run of its own
def test_a_run_of_the_modern_preset_prints_only_its_own_lines(tmp_path: Path, shard_dir: Path) -> None:
    printed = pretrain(tmp_path, shard_dir, "trainer.max_steps=6", experiment="clm_modern")
    assert foreign_lines(printed) == [] and "does not fit in trainer.max_steps=6" in printed


def test_a_resumed_runs_progress_bar_counts_to_max_steps_at_this_processs_rate() -> None:
    """Resumed at step 30 of 60 (2 micro-batches a step), 5 steps in 10 s: Lightning calls no epoch-start hook
    inside an epoch, and its bar then had no total, no time left, and a rate counting the 30 steps before."""
    trainer = SimpleNamespace(global_step=30, max_steps=60, accumulate_grad_batches=2)
    progress = ProgressBar()
    progress.on_train_start(trainer, None)  # type: ignore[arg-type]
    bar = progress.train_progress_bar
    bar.n, bar.start_t = 70, time.time() - 10
    meter = bar.format_meter(**bar.format_dict)
    progress.on_train_end(trainer, None)  # type: ignore[arg-type]
    assert meter.startswith("Training:") and "70/120 [00:10<00:50, 1.00it/s" in " ".join(meter.split()), meter


def test_the_srun_hint_is_left_out_outside_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a SLURM login node Lightning hints at `srun` whenever it looks for SLURM (as `plugins` does)."""
    for key, value in fake_srun(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    hint = "The `srun` command is available on your system but is not used"
    for quiet, shown in ((False, True), (True, False)):
        with warnings.catch_warnings(record=True) as caught:  # puts the filters back after
            warnings.simplefilter("always")
            if quiet:
                quiet_libraries()
            assert not SLURMEnvironment.detect()
        assert any(hint in str(warning.message) for warning in caught) == shown


@pytest.mark.slow  # a run of its own; the quiet default run stays in the fast suite
def test_quiet_false_shows_the_libraries_messages(tmp_path: Path, shard_dir: Path) -> None:
    printed = pretrain(tmp_path, shard_dir, "quiet=false")
    assert "GPU available:" in printed and "Tracking run with wandb" in printed and "Seed set to" in printed
    assert "The `srun` command is available" in printed  # the fake one on PATH


def test_training_a_tokenizer_off_a_terminal_prints_no_blank_lines(
    tmp_path: Path, shard_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data(["tokenizer", "--data", str(shard_dir), "--vocab-size", "300", "--out", str(tmp_path / "t.json")])
    printed = capfd.readouterr()  # what reached the file descriptors: the tokenizers library writes there
    assert printed.out.splitlines() == [printed.out.strip()] and printed.out.startswith("wrote ")
    assert printed.err == ""
