"""A damaged goodput record (a line a user, a crash or a copy spoiled; a pipe, a directory or a link in its place)
never stops training nor `pretrain-goodput`, and never loosens a budget; a start refused after the trainer's set-up
leaves no trace in it, and a stop by a signal ends its attempt with one line."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import tiny_run
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.goodput import cli
from pretraining.extras.goodput.account import account_run
from pretraining.extras.goodput.callback import Goodput
from pretraining.extras.goodput.record import RECORD_FILE, SPENT_ON, RecordWriter, read_record
from pretraining.files import open_to_append

TESTS = Path(__file__).parents[2]
TEST_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
ZERO = dict.fromkeys(SPENT_ON, 0.0)


def pretrain(log_dir: Path, run_name: str, *overrides: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pretraining", *overrides, f"paths.log_dir={log_dir}", f"run_name={run_name}"]
    return subprocess.run(command, env=TEST_ENV, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory, shard_dir: Path) -> Path:
    """A real run's record: stopped by SIGTERM in the validation at step 6 (saved there), then continued to 12."""
    log_dir = tmp_path_factory.mktemp("recorded")
    signalled = [
        "+callbacks.signal._target_=kill.SignalInEveryPhase",
        f"+callbacks.signal.markers={log_dir / 'signalled'}",
        "+callbacks.signal.max_steps=12",
        "+callbacks.signal.phases=[validation_in_training]",
    ]
    overrides = [*tiny_run(), f"data.dir={shard_dir}", "callbacks=[default,goodput]"]
    overrides.append("callbacks.goodput.heartbeat_seconds=0")
    for status in (128 + signal.SIGTERM, 0):
        done = pretrain(log_dir, "run", *overrides, *signalled)
        assert done.returncode == status, done.stdout[-2000:] + done.stderr[-3000:]
    return log_dir / "train" / "runs" / "run"


def valid_record() -> list[dict[str, Any]]:
    """A record by hand: one attempt of 20 s on 2 devices, ended by SIGTERM at step 10."""
    start = {"attempt": 1, "event": "start", "t": 1000.0, "step": 0, "spent": ZERO | {"startup": 10.0}}
    start |= {"started": 990.0, "host": "h", "pid": 1, "devices": 2, "device": "cpu", "resumed_from": None}
    start |= {"max_steps": 20, "device_hour": 1.0}
    spent = ZERO | {"startup": 10.0, "training": 10.0}
    end = {"attempt": 1, "event": "end", "t": 1010.0, "step": 10, "spent": spent, "cause": "SIGTERM"}
    return [start, end]


def write_record(path: Path, lines: list[Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines))


def goodput_answer(run: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    """`pretrain-goodput RUN`'s output and its one-line error ("" if none); fails on any other exception."""
    error = ""
    try:
        cli.main([str(run), *args])
    except SystemExit as exit:
        assert exit.code in (None, 0) or isinstance(exit.code, str), exit.code
        error = exit.code if isinstance(exit.code, str) else ""
    assert "\n" not in error.strip()
    return capsys.readouterr().out, error


def assert_no_wild_figures(text: str) -> None:
    """No NaN, infinity, negative number or figure of 13 digits or more in a report."""
    assert not re.search(r"\b(nan|inf|infinity)\b", text, re.IGNORECASE), text
    assert not re.search(r"(?<![\w.])-\d|\d{13,}", text), text


@pytest.mark.parametrize(
    ("damage", "line"),
    [
        ("a start without attempt", {"event": "start", "t": 1020.0, "step": 0, "spent": ZERO, "started": 1015.0}),
        ("a lone start", {"event": "start"}),
        ("t a string", {"attempt": 1, "event": "progress", "t": "soon", "step": 10, "spent": ZERO}),
        ("spent a list", {"attempt": 1, "event": "progress", "t": 1011.0, "step": 10, "spent": [1, 2]}),
        ("attempt 'one'", {"attempt": "one", "event": "progress", "t": 1011.0, "step": 10, "spent": ZERO}),
        ("t NaN", {"attempt": 1, "event": "progress", "t": math.nan, "step": 10, "spent": ZERO}),
        ("t infinite", {"attempt": 1, "event": "progress", "t": math.inf, "step": 10, "spent": ZERO}),
        ("t negative", {"attempt": 1, "event": "progress", "t": -1e9, "step": 10, "spent": ZERO}),
        ("t huge", {"attempt": 1, "event": "progress", "t": 1e300, "step": 10, "spent": ZERO}),
        ("t back in time", {"attempt": 1, "event": "progress", "t": 1005.0, "step": 10, "spent": ZERO}),
        ("spent more than passed", {"attempt": 1, "event": "progress", "t": 1011, "step": 10, "spent": {"other": 1e6}}),
        ("step huge", {"attempt": 1, "event": "progress", "t": 1011.0, "step": 10**400, "spent": ZERO}),
        ("a devices 'many' start", valid_record()[0] | {"attempt": 2, "devices": "many"}),
        ("a resumed_from 'x' start", valid_record()[0] | {"attempt": 2, "resumed_from": "x"}),
        ("a start without started", {k: v for k, v in valid_record()[0].items() if k != "started"} | {"attempt": 2}),
        ("a price NaN", valid_record()[0] | {"attempt": 2, "device_hour": math.nan}),
        ("an end without cause", {"attempt": 1, "event": "end", "t": 1011.0, "step": 10, "spent": ZERO}),
        (
            "a validation value NaN",
            {"attempt": 1, "event": "validation", "t": 1011, "step": 10, "spent": ZERO, "value": math.nan},
        ),
        ("a foreign line", ["not", "a", "record"]),
        ("nesting past the stack", "[" * 100_000 + "\n"),
        ("an integer of 5000 digits", '{"attempt": ' + "9" * 5000 + "}\n"),
        ("binary", "\x00\xff\xfe garbage\n"),
    ],
)
def test_a_damaged_line_is_named_and_left_out_and_the_report_answers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, line: Any
) -> None:
    run = tmp_path / "run"
    write_record(run / RECORD_FILE, [*valid_record(), line])
    record = read_record(run / RECORD_FILE)
    assert list(record.damaged) == [3], damage
    assert [len(attempt.lines) for attempt in record.attempts] == [1]
    assert f"{run / RECORD_FILE}: 1 damaged line(s) left out of the account and the budget (line 3;" in (
        record.damage() or ""
    )
    out, error = goodput_answer(run, capsys, "--json", str(tmp_path / "report.json"))
    assert not error and "wall time 20.0 s over 1 attempt(s)" in out and "1 damaged line(s)" in out
    assert_no_wild_figures(out)
    assert json.loads((tmp_path / "report.json").read_text())["device_hours"] == 40 / 3600


@pytest.mark.parametrize(
    "status",
    ["{garbage", "[1, 2]", '"running"', '{"status": "running"}', '{"status": "running", "pid": "abc"}', "{}"],
)
def test_a_damaged_status_reads_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str], status: str) -> None:
    write_record(tmp_path / RECORD_FILE, valid_record())
    (tmp_path / "status.json").write_text(status)
    out, error = goodput_answer(tmp_path, capsys)
    assert not error and out.startswith(f"{tmp_path}: unknown (status.json is damaged)\n")


def test_a_record_or_report_that_is_no_file_gets_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_record(tmp_path / "run" / RECORD_FILE, valid_record())
    (tmp_path / "report").mkdir()
    out, error = goodput_answer(tmp_path / "run", capsys, "--json", str(tmp_path / "report"))
    assert out == ""  # refused before the report
    assert (
        error
        == f"pretrain-goodput: --json {tmp_path / 'report'} is a directory, not a file: name a file to write the "
        + ("report to")
    )
    (tmp_path / "dir" / RECORD_FILE).mkdir(parents=True)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / RECORD_FILE).symlink_to(tmp_path / "fifo")
    for run, kind in (("dir", "a directory"), ("pipe", "a named pipe")):
        _, error = goodput_answer(tmp_path / run, capsys)
        assert error.startswith(f"pretrain-goodput: the goodput record {tmp_path / run / RECORD_FILE} is {kind}, not")


@pytest.mark.parametrize("price", ["nan", "inf", "-1", "two"])
def test_a_price_that_is_no_finite_number_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], price: str
) -> None:
    with pytest.raises(SystemExit, match="2"):
        cli.main([str(tmp_path), "--device-hour", price])
    assert f"argument --device-hour: '{price}' is no price: pass a finite number, 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["device_hour", "max_device_hours", "max_cost", "heartbeat_seconds", "slow_share"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_setting_that_is_no_finite_number_is_refused_naming_its_key(tmp_path: Path, key: str, value: float) -> None:
    settings = {"device_hour": 1.0} | {key: value}
    with pytest.raises(ConfigError, match=rf"callbacks\.goodput\.{key}={value}"):
        Goodput(str(tmp_path), **settings)


@pytest.mark.parametrize("t", [math.nan, -1e9, "x", 1e300])
def test_a_damaged_time_does_not_loosen_a_budget(tmp_path: Path, t: Any) -> None:
    """The valid attempt spent 40 s of 2 devices, over a budget of 0.01 device-hours (36 s): a damaged last line
    neither hides that nor disables the budget (it made the spent time NaN, or negative)."""
    damaged = {"attempt": 1, "event": "progress", "t": t, "step": 12, "spent": ZERO | {"training": 11.0}}
    write_record(tmp_path / RECORD_FILE, [*valid_record(), damaged])
    warned = pytest.warns(UserWarning, match=r"1 damaged line\(s\) left out of the account and the budget \(line 3;")
    with warned, pytest.raises(ConfigError, match=r"budget is spent: 0\.0111 device-hours .* nothing was started"):
        Goodput(str(tmp_path), max_device_hours=0.01)


STARTED = 1.7e9  # a Unix time of 2023


def attempt_lines(number: int, started: float, devices: int = 8) -> list[dict[str, Any]]:
    """An attempt of 2 h on `devices`: a start after 60 s of start-up, a heartbeat every 10 min, then killed."""
    start = {"attempt": number, "event": "start", "t": started + 60, "step": 0, "spent": ZERO | {"startup": 60.0}}
    start |= {"started": started, "host": "h", "pid": 1, "devices": devices, "device": "gpu", "resumed_from": None}
    progress = [
        {"attempt": number, "event": "progress", "t": started + seconds, "step": seconds // 6}
        | {"spent": ZERO | {"startup": 60.0, "training": seconds - 60.0}}
        for seconds in range(600, 7201, 600)
    ]
    return [start, *progress]


def two_attempts() -> list[dict[str, Any]]:
    """Two attempts of 2 h on 8 devices (32 device-hours), the second starting an hour after the first died."""
    return attempt_lines(1, STARTED) + attempt_lines(2, STARTED + 3 * 3600)


def device_hours(path: Path, lines: list[Any]) -> float:
    write_record(path, lines)
    return account_run(read_record(path).attempts).device_hours


START_DAMAGE: dict[str, Any] = {
    "devices a string": {"devices": "8"},
    "t NaN": {"t": math.nan},
    "started in 1990": {"started": STARTED - 1e9},
    "t in the year 3300": {"t": STARTED + 4e10},
    "no spent": {"spent": None},
}


@pytest.mark.parametrize("damage", START_DAMAGE)
@pytest.mark.parametrize("attempt", [0, 1])
def test_an_attempt_whose_start_is_damaged_still_counts(tmp_path: Path, damage: str, attempt: int) -> None:
    """The attempt is kept, on a start rebuilt from its next line, on the other attempt's 8 devices: it counts no
    fewer device-hours than the intact record less the damaged line's own (its 60 s of start-up), and no more."""
    intact = device_hours(tmp_path / "intact.jsonl", two_attempts())
    lines = two_attempts()
    start = attempt * 13  # the attempt's start line
    lines[start] = lines[start] | START_DAMAGE[damage]
    path = tmp_path / RECORD_FILE
    got = device_hours(path, lines)
    assert list(read_record(path).damaged) == [start + 1]
    assert len(read_record(path).attempts) == 2
    assert intact - 60 * 8 / 3600 <= got <= intact + 1e-9, (intact, got)


def test_a_start_cut_short_by_a_kill_keeps_its_attempt(tmp_path: Path) -> None:
    lines: list[Any] = two_attempts()
    lines[13] = json.dumps(lines[13])[:40] + "\n"
    assert device_hours(tmp_path / RECORD_FILE, lines) == pytest.approx(32)


@pytest.mark.parametrize("where", [5, 12])  # a heartbeat in the middle, the last
@pytest.mark.parametrize("t", [STARTED + 4e10, STARTED + 7200 + 3600, STARTED + 1e9])
def test_a_time_in_the_future_does_not_inflate_the_account(tmp_path: Path, where: int, t: float) -> None:
    """A heartbeat's time moved to the year 3300, or an hour or years on, disagrees with the seconds it spent: it is
    left out (it made 88,888,889 device-hours, stopping a healthy run)."""
    intact = device_hours(tmp_path / "intact.jsonl", attempt_lines(1, STARTED))
    lines = attempt_lines(1, STARTED)
    lines[where] = lines[where] | {"t": t}
    path = tmp_path / RECORD_FILE
    got = device_hours(path, lines)
    assert list(read_record(path).damaged) == [where + 1]
    assert intact - 600 * 8 / 3600 <= got <= intact, (intact, got)


def test_a_line_of_the_next_attempt_within_an_attempt_is_no_attempt(tmp_path: Path) -> None:
    """A heartbeat whose attempt number reads 2 would begin an attempt before attempt 1's last line: damaged, not
    a second attempt counting attempt 1's hours again."""
    lines = attempt_lines(1, STARTED)
    lines[6] = lines[6] | {"attempt": 2}
    path = tmp_path / RECORD_FILE
    assert device_hours(path, lines) == pytest.approx(16)
    assert list(read_record(path).damaged) == [7] and len(read_record(path).attempts) == 1


def test_a_restart_counts_an_attempt_whose_start_is_damaged_on_its_own_devices(tmp_path: Path) -> None:
    """The record's only start is damaged: the reader knows no devices (it counts 1, 2 device-hours), the restart on
    8 counts 16 and refuses to start over a budget of 10, as on the intact record."""
    write_record(tmp_path / RECORD_FILE, attempt_lines(1, STARTED))
    with pytest.raises(ConfigError, match=r"budget is spent: 16 device-hours"):
        Goodput(str(tmp_path), max_device_hours=10)
    lines = attempt_lines(1, STARTED)
    write_record(tmp_path / RECORD_FILE, [lines[0] | {"devices": "8"}, *lines[1:]])
    with pytest.warns(UserWarning, match=r"1 damaged line\(s\)"):
        goodput = Goodput(str(tmp_path), max_device_hours=10)
    assert goodput.spent_before == pytest.approx(2)
    trainer = SimpleNamespace(world_size=8, strategy=SimpleNamespace(broadcast=lambda value: value))
    with pytest.raises(ConfigError, match=r"budget is spent: 16 device-hours .* nothing was started"):
        goodput.begin(trainer, SimpleNamespace())  # type: ignore[arg-type]


def test_a_record_that_is_no_file_is_refused_before_set_up(tmp_path: Path) -> None:
    """A pipe would block the set-up, a link be appended through: refused when the callback is made."""
    outside = tmp_path / "outside.jsonl"
    write_record(outside, valid_record())
    kinds = {"pipe": (os.mkfifo, "a named pipe"), "dir": (os.mkdir, "a directory")}
    kinds["link"] = (lambda path: os.symlink(outside, path), "a symbolic link")
    for name, (make, kind) in kinds.items():
        (tmp_path / name).mkdir()
        make(tmp_path / name / RECORD_FILE)
        with pytest.raises(MissingFileError, match=f"the goodput record .*{name}/{RECORD_FILE} is {kind}, not a file"):
            Goodput(str(tmp_path / name))
        with pytest.raises(MissingFileError, match=f"is {kind}, not a file"):
            open_to_append(tmp_path / name / RECORD_FILE, "the goodput record", "move it aside")
    assert outside.read_text() == "".join(json.dumps(line) + "\n" for line in valid_record())


def test_a_withdrawn_start_leaves_the_record_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / RECORD_FILE
    path.write_bytes(b'{"attempt": 1, "ev')  # ends mid-line: the writer starts a line of its own
    writer = RecordWriter(path)
    writer.write(valid_record()[0])
    writer.withdraw()
    assert path.read_bytes() == b'{"attempt": 1, "ev'
    fresh = RecordWriter(tmp_path / "new.jsonl")
    fresh.write(valid_record()[0])
    fresh.withdraw()
    assert not (tmp_path / "new.jsonl").exists()


@pytest.mark.slow  # 40 s: the module's real run, twice
def test_a_sigterm_in_a_validation_ends_its_attempt_with_one_line(recorded_run: Path) -> None:
    attempts = read_record(recorded_run / RECORD_FILE).attempts
    assert [attempt.cause for attempt in attempts] == ["SIGTERM", "completed"]
    assert [[line["event"] for line in attempt.lines].count("end") for attempt in attempts] == [1, 1]


# Every way a field can be damaged: removed, retyped, NaN, infinite, negative, huge.
REMOVED = object()
DAMAGE: list[Any] = [REMOVED, "x", [1], {"a": 1}, True, None, math.nan, math.inf, -math.inf, -1e9, -1, 1e300, 10**400]


def damaged_copy(lines: list[dict[str, Any]], rng: random.Random) -> list[dict[str, Any]]:
    """`lines` with one to three fields (or fields of `spent`) damaged at random."""
    lines = copy.deepcopy(lines)
    for _ in range(rng.randint(1, 3)):
        line = rng.choice(lines)
        holder = line["spent"] if "spent" in line and isinstance(line["spent"], dict) and rng.random() < 0.3 else line
        if not holder:
            continue
        key, damage = rng.choice(sorted(holder)), rng.choice(DAMAGE)
        if damage is REMOVED:
            del holder[key]
        else:
            holder[key] = damage
    return lines


@pytest.mark.slow  # the module's real run (40 s), then 6 s
def test_random_damage_never_stops_the_reader_nor_the_report(
    recorded_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    valid = [json.loads(line) for line in (recorded_run / RECORD_FILE).read_text().splitlines()]
    rng = random.Random(54)
    run, report = tmp_path / "run", tmp_path / "report.json"
    for case in range(300):
        write_record(run / RECORD_FILE, damaged_copy(valid, rng))
        account = account_run(read_record(run / RECORD_FILE).attempts)
        assert 0 <= account.device_hours < 1 and 0 <= account.goodput <= 1.001, case
        with warnings.catch_warnings():  # the damage warning
            warnings.simplefilter("ignore")
            Goodput(str(run), max_device_hours=1)  # a restart reads it: no budget spent, nothing raised
        out, error = goodput_answer(run, capsys, "--json", str(report))
        assert not error, (case, error)
        assert_no_wild_figures(out)
        assert "NaN" not in report.read_text() and "Infinity" not in report.read_text(), case


@pytest.mark.slow  # the module's real run (40 s), then a run of 20 s
def test_a_run_starts_on_a_damaged_record_warns_once_and_trains(
    recorded_run: Path, tmp_path: Path, shard_dir: Path
) -> None:
    """The issue's damage added to a real record: the run warns once naming the lines, and trains to its end; its
    log file, a link here, is not written through."""
    run = tmp_path / "train" / "runs" / "damaged"
    run.mkdir(parents=True)
    shutil.copy(recorded_run / RECORD_FILE, run / RECORD_FILE)
    lines = len((run / RECORD_FILE).read_text().splitlines())
    damage = [
        {"event": "start", "t": 1.0, "step": 0, "spent": ZERO, "started": 0.0},
        {"attempt": 2, "event": "progress", "t": "soon", "step": 12, "spent": ZERO},
        {"attempt": 2, "event": "progress", "t": math.nan, "step": 12, "spent": ZERO},
        {"event": "start"},
    ]
    with (run / RECORD_FILE).open("a") as file:
        file.write("".join(json.dumps(line) + "\n" for line in damage))
    outside = tmp_path / "outside.log"
    outside.write_text("")
    (run / "train.log").symlink_to(outside)
    done = pretrain(tmp_path, "damaged", *tiny_run(), f"data.dir={shard_dir}", "callbacks=[default,goodput]")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    numbers = ", ".join(str(lines + n) for n in range(1, 5))
    assert (
        output.count(f"{run / RECORD_FILE}: 4 damaged line(s) left out of the account and the budget (line {numbers};")
        == 1
    )
    assert f"warning: the run's log file {run / 'train.log'} is a symbolic link" in output
    attempts = read_record(run / RECORD_FILE).attempts
    assert [attempt.cause for attempt in attempts] == ["SIGTERM", "completed", "completed"]
    assert outside.read_text() == ""


@pytest.mark.slow  # 25 s: a process refused after building the model and the trainer
def test_a_start_refused_after_the_set_up_leaves_nothing(tmp_path: Path, shard_dir: Path) -> None:
    """A missing teacher is found at the student's set-up, after the goodput callback's: the refusal is one line,
    counts as no attempt and leaves no run directory, as without the extra."""
    teacher = ["model.teacher=/no/such.ckpt", "callbacks=[default,goodput]"]
    done = pretrain(tmp_path, "refused", *tiny_run("distill_tiny"), f"data.dir={shard_dir}", *teacher)
    assert done.returncode == 1 and "/no/such.ckpt: no such checkpoint" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "train" / "runs" / "refused").exists()
