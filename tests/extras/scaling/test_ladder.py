"""The scaling ladder (`pretraining.extras.scaling.ladder`, `pretrain-scaling ladder`): the power law and its
intervals, the rungs' parameters and steps, the command's files and refusals, a rerun that trains nothing, and a
ladder killed in a rung whose run saves and stops with it."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pretraining.checkpoint import saved_checkpoints
from pretraining.extras.scaling import power_law
from pretraining.extras.scaling.cli import main
from pretraining.extras.scaling.ladder import Rung, plan, rung_dir
from pretraining.job_status import read_status

TESTS = Path(__file__).parents[2]
TEST_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
# Rungs of 256-token steps: at 0.5 tokens per parameter, 16x1 trains 8 steps, 48x2 108.
SMALL = ["data.global_batch_size=4", "model.backbone.max_seq_len=64", "data.num_workers=0", "data.val_size=8"]
LADDER = ["ladder", "--shapes", "16x1", "24x1", "32x1", "32x2", "--next", "48x2"]


def test_a_power_law_finds_its_parameters_and_its_intervals_cover_the_truth() -> None:
    x = np.geomspace(1e10, 1e13, 6)
    truth = 1.2 + 4e3 * x**-0.4
    exact = power_law.fit(list(x), list(truth))
    assert (exact.irreducible, exact.coefficient, exact.exponent) == pytest.approx((1.2, 4e3, 0.4), rel=1e-4)
    assert exact.scatter == pytest.approx(0, abs=1e-6) and exact(3e13) == pytest.approx(1.2 + 4e3 * 3e13**-0.4)
    noisy = power_law.fit(list(x), list(truth * np.exp(np.random.default_rng(0).normal(0, 0.005, len(x)))))
    low, high = noisy.exponent_interval
    assert low < 0.4 < high
    beyond = 4e13
    near, far = noisy.interval(float(x[-1])), noisy.interval(beyond)
    assert far[0] < 1.2 + 4e3 * beyond**-0.4 < far[1]
    assert far[1] - far[0] > near[1] - near[0]  # wider the further past the points
    with pytest.raises(ValueError, match="four positive points or more"):
        power_law.fit([1.0, 2.0, 3.0], [3.0, 2.0, 1.5])


def test_each_rung_counts_its_layers_parameters_and_trains_its_ratio_of_tokens(shard_dir: Path) -> None:
    overrides = ["experiment=ladder", f"data.dir={shard_dir}", *SMALL]
    rungs = plan([(16, 2), (32, 3)], 0.5, overrides)
    for rung, (width, depth) in zip(rungs, [(16, 2), (32, 3)], strict=True):
        mlp = 64 * math.ceil(8 * width / 3 / 64)  # the gated MLP's width, rounded up to a multiple of 64
        head = width // 4
        # Each layer's attention (4 matrices), gated MLP (3), two norms and QK-norm's two (clm_modern's).
        assert rung.parameters == depth * (4 * width * width + 3 * width * mlp + 2 * width + 2 * head)
        assert rung.steps == round(0.5 * rung.parameters / 256) and rung.tokens == 256 * rung.steps
        assert rung.compute == 6 * rung.parameters * rung.tokens


def test_a_rung_of_other_settings_has_a_directory_of_its_own(tmp_path: Path) -> None:
    rung = Rung(width=24, depth=1, parameters=6972, steps=136, tokens=139264)
    here = rung_dir(tmp_path, rung, ["experiment=ladder"])
    assert here.parent == tmp_path.resolve() / "rungs" and here.name.startswith("24x1-")
    assert rung_dir(tmp_path, rung, ["experiment=ladder"]) == here
    assert rung_dir(tmp_path, rung, ["model.optimizer.lr_scale=1.0", "experiment=ladder"]) == here  # the config's
    assert rung_dir(tmp_path, rung, ["experiment=ladder", "model.optimizer.lr_scale=2"]) != here
    assert rung_dir(tmp_path, Rung(24, 1, 6972, 68, 69632), ["experiment=ladder"]) != here  # another ratio's steps
    assert rung_dir(tmp_path, rung, ["experiment=clm_modern"]) != here


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--shapes", "16x1", "24x1", "32x1"], r"four shapes or more \(the fit has three parameters\)"),
        (["--shapes", "32x1", "16x1", "48x1", "64x1"], "give the shapes smallest first"),
        (["--shapes", "16x1", "24x1", "32x1", "48x1", "--next", "16x2"], "and --next the largest"),
        (["--shapes", "16x1", "24", "32x1", "48x1"], "a shape is WIDTHxDEPTH"),
        (["--tokens-per-parameter", "0"], "at a positive ratio"),
        (["trainer.max_steps=5"], "the ladder sets trainer.max_steps for each rung"),
        (["model.backbone.d_model=64"], "the ladder sets model.backbone.d_model for each rung"),
        (["hydra.run.dir=/tmp/x"], "--out choose"),
        (["trainer.max_time=00:00:01:00"], "it would end a rung early"),
        (["model.backbone.n_head=5"], "n_head"),
        (["no_such_key=1"], "no_such_key"),
    ],
)
def test_settings_the_ladder_cannot_run_are_refused_before_any_training(
    tmp_path: Path, shard_dir: Path, arguments: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["ladder", f"data.dir={shard_dir}", *arguments, "--out", str(tmp_path)])
    assert re.search(words, f"{refused.value} {capsys.readouterr().err}")  # ours, or argparse's usage error
    assert not any(tmp_path.iterdir())


def ladder(out: Path, shard_dir: Path, *more: str) -> subprocess.Popen[str]:
    command = [str(Path(sys.executable).parent / "pretrain-scaling"), *LADDER, "--out", str(out)]
    command += ["--tokens-per-parameter", "0.5"]
    command += [f"data.dir={shard_dir}", *SMALL, *more]
    return subprocess.Popen(command, env=TEST_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # five short runs, then found finished
def test_the_ladder_fits_predicts_measures_and_a_rerun_trains_nothing(tmp_path: Path, shard_dir: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "ladder"
    output, _ = ladder(out, shard_dir).communicate(timeout=600)
    assert "Traceback" not in output and "the prediction is off by" in output, output[-3000:]
    record = json.loads((out / "ladder.json").read_text())
    assert [row["rung"] for row in record["rungs"]] == ["16x1", "24x1", "32x1", "32x2", "48x2"]
    assert [row["fitted"] for row in record["rungs"]] == [True, True, True, True, False]
    losses = [row["val_loss"] for row in record["rungs"]]
    assert losses == sorted(losses, reverse=True)  # larger and longer, lower
    law = record["fits"]["compute"]
    following = record["rungs"][-1]
    predicted = law["irreducible"] + law["coefficient"] * following["compute"] ** -law["exponent"]
    assert record["next"]["predicted"] == pytest.approx(predicted)
    assert record["next"]["measured"] == losses[-1]
    assert record["next"]["error"] == pytest.approx(predicted / losses[-1] - 1)
    assert record["fits"]["compute"]["exponent"] > 0 and record["fits"]["parameters"]["exponent"] > 0
    assert (out / "ladder.csv").read_text().count("\n") == 6
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = sidecar_times(out)
    assert len(written) == 5  # each rung's last step (fewer steps than callbacks.checkpoint.every_n_steps)

    again, _ = ladder(out, shard_dir).communicate(timeout=600)
    assert again.splitlines()[-8:] == output.splitlines()[-8:]
    assert sidecar_times(out) == written  # every rung found finished: nothing saved again


def sidecar_times(out: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in (out / "rungs").glob("*/checkpoints/*.json")}


def rung_of(out: Path, shape: str) -> Path:
    """The directory of the rung of `shape` (named with a hash of its overrides), once it exists."""
    found = list((out / "rungs").glob(f"{shape}-*"))
    return found[0] if found else out / "rungs" / shape


@pytest.mark.slow  # a run stopped with its ladder (then, after SIGKILL, the ladder again)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_ladder_stops_its_rung_with_a_checkpoint_and_continues(
    tmp_path: Path, shard_dir: Path, stop: signal.Signals
) -> None:
    if stop == signal.SIGKILL and sys.platform != "linux":
        pytest.skip("the kernel stops the rung of a killed ladder on Linux (prctl)")
    out = tmp_path / "ladder"
    slow = ["+callbacks.slow._target_=kill.SleepEachStep", "+callbacks.slow.seconds=0.2"]
    overrides = [*slow, "callbacks.checkpoint.every_n_steps=2"]
    process = ladder(out, shard_dir, *overrides)
    deadline = time.monotonic() + 120
    while not saved_checkpoints(rung_of(out, "16x1") / "checkpoints") and time.monotonic() < deadline:
        time.sleep(0.2)
    rung = rung_of(out, "16x1")
    process.send_signal(stop)  # SIGTERM: passed on; SIGKILL, which no handler sees: the kernel's SIGTERM to the rung
    output, _ = process.communicate()
    pid, deadline = read_status(rung)["pid"], time.monotonic() + 60
    if stop == signal.SIGTERM:  # the ladder waited for its rung, and exits as `pretrain` does on the signal
        assert process.returncode == 128 + signal.SIGTERM and not alive(pid), output[-3000:]
        assert "SIGTERM stopped the ladder in rung 16x1" in output and "Traceback" not in output
        assert read_status(rung)["status"] == "stopped"
        return  # continuing is the same as after SIGKILL's stop
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    status = read_status(rung)
    assert status["status"] == "stopped" and not alive(pid), status
    (stopped, _), *_ = saved_checkpoints(rung / "checkpoints")
    assert 2 <= stopped < 8 and stopped == status["step"]

    output, _ = ladder(out, shard_dir, *overrides).communicate(timeout=600)
    assert "the prediction is off by" in output, output[-3000:]
    assert f"resuming from {rung / 'checkpoints'}" in (rung / "train.log").read_text()
    assert saved_checkpoints(rung / "checkpoints")[0][0] == 8


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not)."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z"
