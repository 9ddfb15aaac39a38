"""The goodput extra: a run's time, restarts and cost accounted for from its record, checked against what the
test did to it (killed, signalled, crashed, slowed, starved of data); a budget that stops a run and refuses
its restart; alerts raised once each."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import IterableDataset

import pretraining.data.datamodule
from conftest import tiny_run
from pretraining.checkpoint import saved_checkpoints
from pretraining.errors import ConfigError
from pretraining.extras.goodput import alerts, cli
from pretraining.extras.goodput.account import KILLED, account_run, amount
from pretraining.extras.goodput.callback import Goodput
from pretraining.extras.goodput.record import RECORD_FILE, SPENT_ON, read_record
from pretraining.job_status import read_status
from pretraining.train import train

TESTS = Path(__file__).parents[2]
TEST_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
WITH_GOODPUT = "callbacks=[default,goodput]"  # the extra is opt-in


@pytest.fixture
def compose_train(compose_train: Any) -> Any:
    """The shared fixture's tiny run, with the goodput callback."""
    return lambda *overrides, **options: compose_train(WITH_GOODPUT, *overrides, **options)


def pretrain(log_dir: Path, overrides: list[str]) -> tuple[int, str, float]:
    """Run `pretrain` (run `run`) in its own process group: its exit status, its output and its wall time."""
    command = [
        sys.executable,
        "-m",
        "pretraining",
        WITH_GOODPUT,
        *overrides,
        f"paths.log_dir={log_dir}",
        "run_name=run",
    ]
    started = time.time()
    process = subprocess.Popen(
        command, env=TEST_ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, output, time.time() - started


def report(run: Path, *args: str) -> dict[str, Any]:
    out = run / "report.json"
    cli.main([str(run), "--json", str(out), *args])
    return json.loads(out.read_text())


def alerts_raised(run: Path) -> list[tuple[int, str]]:
    attempts = read_record(run / RECORD_FILE).attempts
    return [(a.number, line["condition"]) for a in attempts for line in a.lines if line["event"] == "alert"]


def test_a_run_killed_signalled_and_crashed_is_accounted_for(
    tmp_path: Path, shard_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed (SIGKILL) after step 20, stopped by SIGTERM after step 30 (saving at the next step's end), crashed
    after step 38, then completed: every figure of the report against what was done, to the second where it is
    timed."""
    overrides = [
        *tiny_run(),
        f"data.dir={shard_dir}",
        "trainer.max_steps=40",
        "trainer.val_check_interval=20",
        "callbacks.checkpoint.every_n_steps=8",
        "callbacks.goodput.heartbeat_seconds=0",
        "callbacks.goodput.device_hour=3",
        "callbacks.goodput.restarts_per_hour=1",
        "callbacks.goodput.restore_seconds=0",
    ]
    interruptions = [
        (["+callbacks.stop._target_=kill.KillAt", "+callbacks.stop.batch=20"], -signal.SIGKILL),
        (["+callbacks.stop._target_=kill.SignalAt", "+callbacks.stop.batch=30", "+callbacks.stop.signum=15"], 143),
        (["+callbacks.stop._target_=kill.RaiseAt", "+callbacks.stop.batch=38"], 1),
        ([], 0),
    ]
    walls, outputs = [], []
    for extra, status in interruptions:
        code, output, wall = pretrain(tmp_path, [*overrides, *extra])
        assert code == status, output[-3000:]
        walls.append(wall)
        outputs.append(output)
    run = tmp_path / "train" / "runs" / "run"
    got = report(run)

    attempts = got["attempts"]
    assert [a["resumed_from"] for a in attempts] == [None, 16, 31, 32]  # the saves before each interruption
    assert [a["last_step"] for a in attempts] == [20, 31, 38, 40]
    assert [a["kept_step"] for a in attempts] == [16, 31, 32, 40]
    assert [a["cause"] for a in attempts] == [
        KILLED,
        "SIGTERM",
        "error: RuntimeError: a crash after batch 38",
        "completed",
    ]
    assert got["causes"] == {KILLED: 1, "SIGTERM": 1, "error: RuntimeError: a crash after batch 38": 1}
    assert (got["restarts"], got["step"], got["max_steps"], got["status"]) == (3, 40, 40, "completed")
    assert got["steps_redone"] == 10  # 20-16, 31-31, 38-32
    assert "stopped by SIGTERM at step 31 of trainer.max_steps=40; run the same command to continue" in outputs[1]
    # Each attempt's wall time is its process's, as the test timed it (the start is known to about a second).
    for attempt, wall in zip(attempts, walls, strict=True):
        assert wall - 15 < attempt["wall"] < wall + 1.1
    # Every second is accounted for once: kept, by what it went to, or lost after the last save.
    assert got["wall_seconds"] == pytest.approx(sum(a["wall"] for a in attempts))
    assert sum(got["seconds"].values()) == pytest.approx(got["wall_seconds"])
    assert got["seconds"]["redone"] == pytest.approx(sum(a["lost"] for a in attempts))
    assert attempts[0]["lost"] > 0 and attempts[2]["lost"] > 0 and attempts[3]["lost"] == 0
    assert got["productive_seconds"] == got["seconds"]["training"] > 0
    assert got["goodput"] == pytest.approx(got["productive_seconds"] / got["wall_seconds"])
    restarts = sum(a["kept"]["startup"] + a["kept"]["setup"] for a in attempts[1:])
    assert got["lost_to_restarts_seconds"] == pytest.approx(restarts + got["seconds"]["redone"])
    assert attempts[1]["kept"]["validation"] > 0 and attempts[3]["kept"]["validation"] > 0  # at steps 20 and 40
    # Cost: one CPU device, at 3 a device-hour.
    assert got["device_hours"] == pytest.approx(got["wall_seconds"] / 3600)
    assert got["cost"] == pytest.approx(3 * got["device_hours"])
    assert got["cost_lost_to_restarts"] == pytest.approx(3 * got["lost_to_restarts_seconds"] / 3600)
    assert got["projected_cost_to_max_steps"] == 0
    # The printed report says the same; the run's summary has the cost line.
    printed = capsys.readouterr().out
    assert f"goodput {got['goodput']:.1%}" in printed and "restarts 3;" in printed
    assert "steps re-done" in printed and "(10 steps)" in printed  # 20-16, 31-31, 38-32
    assert "over 4 attempt(s), 3 restart(s)" in outputs[-1] and f"cost {amount(got['cost'])}" in outputs[-1]
    # Alerts, once a run each: the first restore (any, over 0 s), and the crash loop at the second restart
    # after a crash (the kill, the error; the SIGTERM was a clean stop).
    assert alerts_raised(run) == [(2, "slow_restore"), (4, "crash_loop")]
    # The goodput at each validation, on the CSV log: the last attempt's counts its three restarts.
    with (run / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("goodput/goodput")]
    assert [row["step"] for row in rows] == ["0", "20", "40"]  # the validations, before training and at 20, 40
    assert float(rows[0]["goodput/goodput"]) == 0 and 0 < float(rows[-1]["goodput/goodput"]) < 1
    assert float(rows[-1]["goodput/restarts"]) == 3


def test_a_budget_stops_the_run_with_a_checkpoint_and_refuses_its_restart(tmp_path: Path, shard_dir: Path) -> None:
    budget = 0.005  # device-hours: 18 s of one device, start-up included
    run_overrides = [
        *tiny_run(),
        f"data.dir={shard_dir}",
        "trainer.val_check_interval=100",
        "callbacks.goodput.heartbeat_seconds=0",
    ]
    slow = ["+callbacks.slow._target_=kill.SleepEachStep", "+callbacks.slow.seconds=0.02"]
    overrides = [*run_overrides, *slow, "trainer.max_steps=5000", f"callbacks.goodput.max_device_hours={budget}"]
    code, output, _ = pretrain(tmp_path, overrides)
    assert code == 0, output[-3000:]
    run = tmp_path / "train" / "runs" / "run"
    (step, _), *_ = saved_checkpoints(run / "checkpoints")
    assert 0 < step < 5000 and step % 10 == 0  # at a logging step, saved
    status = read_status(run)
    assert status["status"] == "stopped" and status["step"] == step
    assert "callbacks.goodput.max_device_hours" in status["stopped_by"] and "is spent" in status["stopped_by"]
    assert f"stopped at step {step} of trainer.max_steps=5000: the run's budget is spent" in output
    assert budget <= report(run)["device_hours"]
    # It stopped at the first logging step past the budget: at the one before, the budget was not spent yet.
    (attempt,) = read_record(run / RECORD_FILE).attempts
    before = [line["t"] for line in attempt.lines if line["event"] == "progress" and line["step"] == step - 10]
    assert step == 10 or (before[0] - attempt.start["started"]) / 3600 < budget

    code, output, _ = pretrain(tmp_path, overrides)
    assert code == 1 and "Traceback" not in output
    assert "nothing was started. To continue, raise callbacks.goodput.max_device_hours" in output
    assert len(read_record(run / RECORD_FILE).attempts) == 1  # the refused start is no attempt

    raised = [*run_overrides, f"trainer.max_steps={step + 10}", "callbacks.goodput.max_device_hours=1"]
    code, output, _ = pretrain(tmp_path, raised)
    assert code == 0, output[-3000:]
    attempts = read_record(run / RECORD_FILE).attempts
    assert [a.start["resumed_from"] for a in attempts] == [None, step]
    assert attempts[-1].cause == "completed"
    # Finished, it is run again with its first budget (spent): it reports the run, nothing refused.
    code, output, _ = pretrain(tmp_path, [*raised[:-1], f"callbacks.goodput.max_device_hours={budget}"])
    assert code == 0 and "the run is complete" in output, output[-3000:]


def test_a_flat_validation_loss_is_alerted_once_and_can_stop_the_run(
    compose_train: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a learning rate of 1e-9 the validation loss does not move: after 2 more validations than the alert
    waits for, one warning, one W&B alert, one line in the record; with stop_on, the run stops there, saved."""
    wandb_alerts: list[str] = []
    monkeypatch.setattr("wandb.sdk.wandb_run.Run.alert", lambda run, title, text, **kwargs: wandb_alerts.append(title))
    flat = [
        "model.optimizer.lr=1e-9",
        "callbacks.goodput.min_improvement=0.001",
        "trainer.val_check_interval=2",
        "trainer.max_steps=16",
        "callbacks.goodput.flat_validations=3",
    ]
    with pytest.warns(UserWarning, match="goodput alert, no_improvement: val/loss has not improved") as warned:
        train(compose_train(*flat, "logger=default"))
    assert len([w for w in warned if "goodput alert" in str(w.message)]) == 1
    assert alerts_raised(tmp_path) == [(1, "no_improvement")]
    assert wandb_alerts == [f"no_improvement ({tmp_path.name})"]
    assert account_run(read_record(tmp_path / RECORD_FILE).attempts).step == 16  # the alert did not stop it

    stopping = tmp_path / "stopping"
    with pytest.warns(UserWarning, match="no_improvement"):
        train(compose_train(*flat, f"paths.output_dir={stopping}", "callbacks.goodput.stop_on=[no_improvement]"))
    # Validations at 0, 2, 4, 6: the fourth after the first finds no improvement; the next logging step stops.
    (attempt,) = read_record(stopping / RECORD_FILE).attempts
    assert attempt.cause.startswith("the alert no_improvement (callbacks.goodput.stop_on): val/loss has not")
    (step, _), *_ = saved_checkpoints(stopping / "checkpoints")
    assert step == 10


def test_a_starved_loader_and_a_slow_device_are_alerted_and_their_time_accounted_for(
    compose_train: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each training batch delayed by 0.1 s in the loader: the data wait the report gives is at least that
    delay for every batch; then steps slowed 20-fold from step 60: the slow-step alert."""
    delay, loader = 0.1, pretraining.data.datamodule.training_loader

    def throttled(stream: Any, *args: Any) -> Any:
        def delayed() -> Any:
            for batch in stream:
                time.sleep(delay)
                yield batch

        return loader(Throttle(delayed), *args)

    monkeypatch.setattr(pretraining.data.datamodule, "training_loader", throttled)
    steps = 30
    quiet = ["callbacks.goodput.slow_steps=20", "callbacks.goodput.flat_validations=null"]
    with pytest.warns(UserWarning, match="goodput alert, data_wait: the training loop waited for data"):
        train(compose_train(f"trainer.max_steps={steps}", *quiet))
    got = account_run(read_record(tmp_path / RECORD_FILE).attempts)
    assert steps * delay <= got.spent["data_wait"] < steps * delay + 1.0
    assert alerts_raised(tmp_path) == [(1, "data_wait")]

    monkeypatch.setattr(pretraining.data.datamodule, "training_loader", loader)
    slow = tmp_path / "slow"
    sleeper = ["+callbacks.slow._target_=kill.SleepEachStep", "+callbacks.slow.seconds=0.1", "+callbacks.slow.after=60"]
    with pytest.warns(UserWarning, match="goodput alert, slow_steps: steps are slow"):
        train(compose_train("trainer.max_steps=90", f"paths.output_dir={slow}", *quiet, *sleeper))
    assert alerts_raised(slow) == [(1, "slow_steps")]


class Throttle(IterableDataset):
    """An iterable dataset over a generator function (made again for each iteration)."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __iter__(self) -> Any:
        return self.make()


def test_the_account_of_a_record_written_by_hand(tmp_path: Path) -> None:
    """Two attempts on 2 devices: the first killed 5 s after its save at step 10, which the second resumed
    from; the second stopped by SIGTERM at step 20 of 30."""
    zero = dict.fromkeys(SPENT_ON, 0.0)
    first = {"attempt": 1, "devices": 2, "max_steps": 30, "device_hour": 1.0}
    second = first | {"attempt": 2}
    lines = [
        first | {"event": "start", "t": 10, "step": 0, "spent": zero | {"startup": 10}, "started": 0},
        first
        | {"event": "progress", "t": 50, "step": 10, "spent": zero | {"startup": 10, "training": 30, "saving": 10}},
        first
        | {"event": "progress", "t": 55, "step": 12, "spent": zero | {"startup": 10, "training": 35, "saving": 10}},
        second
        | {"event": "start", "t": 110, "step": 0, "spent": zero | {"startup": 10}, "started": 100, "resumed_from": 10},
        second
        | {
            "event": "end",
            "t": 150,
            "step": 20,
            "spent": zero | {"startup": 10, "setup": 10, "training": 30},
            "cause": "SIGTERM",
        },
    ]
    path = tmp_path / RECORD_FILE
    path.write_text("\n".join(map(json.dumps, lines)) + '\n{"attempt": 2, "ev')  # the last line cut short
    record = read_record(path)
    attempts, got = record.attempts, account_run(record.attempts)
    assert list(record.damaged) == [6]
    assert [attempt.cause for attempt in attempts] == [None, "SIGTERM"]
    assert got.wall == 55 + 50
    assert got.spent == zero | {"startup": 20, "setup": 10, "training": 60, "saving": 10, "redone": 5}
    assert got.goodput == 60 / 105
    assert got.lost_to_restarts == 10 + 10 + 5  # the restart's start-up and restore, the steps after step 10
    assert got.causes == {KILLED: 1}
    assert got.device_hours == 105 * 2 / 3600 and got.cost(got.device_hours) == got.device_hours
    # The pace without restarts: (training + saving) 70 s over 20 steps; 10 steps left, on 2 devices.
    assert got.seconds_per_step == 3.5 and got.projection() == pytest.approx(10 * 3.5 * 2 / 3600)
    assert math.isclose(got.restart_device_hours, 25 * 2 / 3600)
    assert got.steps_redone == 2


def test_a_crash_loop_counts_the_restarts_after_a_crash_within_the_hour() -> None:
    assert alerts.crash_loop([100, 7000, 7100, 7200], now=7300, limit=2) is not None  # 3 in the hour
    assert alerts.crash_loop([100, 200, 7100, 7200], now=7300, limit=2) is None  # 2


def test_a_sweeps_report_gives_each_job_and_the_share_that_completed(tmp_path: Path) -> None:
    zero = dict.fromkeys(SPENT_ON, 0.0)
    start = {"attempt": 1, "event": "start", "t": 1, "step": 0, "spent": zero | {"startup": 1}, "started": 0}
    for job, status in enumerate(["completed", "failed", "completed", "stopped"]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "status.json").write_text(json.dumps({"status": status}))
        end = {"attempt": 1, "event": "end", "t": 11, "step": 5, "spent": zero | {"startup": 1, "training": 10}}
        end["cause"] = status
        if job != 1:  # the failed job has no record
            (tmp_path / str(job) / RECORD_FILE).write_text(f"{json.dumps(start)}\n{json.dumps(end)}\n")
    (tmp_path / "multirun.yaml").write_text("")
    got = report(tmp_path, "--device-hour", "36")
    assert got["success_rate"] == 0.5
    assert got["statuses"] == {"completed": 2, "failed": 1, "stopped": 1}
    assert [job["job"] for job in got["jobs"]] == ["0", "1", "2", "3"]
    assert got["jobs"][0]["goodput"] == 10 / 11 and got["jobs"][0]["cost"] == pytest.approx(36 * 11 / 3600)
    assert "goodput" not in got["jobs"][1] and "cannot be accounted for" in got["jobs"][1]["unaccounted"][0]


def test_a_run_whose_process_is_gone_reads_interrupted_not_running(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record = {"status": "running", "host": socket.gethostname(), "pid": gone.pid}
    (tmp_path / "status.json").write_text(json.dumps(record))
    assert report(tmp_path)["status"] == "interrupted"


def test_a_run_without_a_record_says_what_cannot_be_accounted_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    got = report(tmp_path / "run")
    assert "cannot be accounted for" in got["unaccounted"][0]
    assert "not accounted for" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is neither a run directory"):
        cli.main([str(tmp_path / "nothing")])
    with pytest.raises(ConfigError, match="max_cost=5 needs a price"):
        Goodput(str(tmp_path), max_cost=5)
    with pytest.raises(ConfigError, match=r"stop_on names no alert: \['slow_step'\]"):
        Goodput(str(tmp_path), stop_on=["slow_step"])
