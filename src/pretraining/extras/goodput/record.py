"""A run's goodput record: `<run dir>/goodput.jsonl`, appended to by rank zero's `Goodput` callback, one
JSON object per line, never rewritten.

Every line has `attempt` (1 for the run's first process, 2 for the first restart, ...), `event`, `t` (Unix
time), `step` (optimizer steps done) and `spent`: the seconds since the process started, by what they went to
(`SPENT_ON`; they add up to `t` minus the start). The events:

- `start`, once per process, at the trainer's set-up: also `started` (when the process started), `host`,
  `pid`, `devices`, `device` (its kind), `resumed_from` (the step it continues, null for a fresh start),
  `max_steps` and `device_hour` (the price given, or null);
- `progress` (every `heartbeat_seconds` at a logging step, and after each save), `validation` (with
  `value`, the monitored metric), `alert` (`condition`, `message`), `end` (`cause`: `completed`, what
  stopped training, or the error).

A process killed without warning (SIGKILL, the OOM killer, a lost machine) writes no `end`: its account
stops at its last line, at most a heartbeat before it died. `read_record` checks every line's fields: one cut
short by such a kill, or damaged by a user, a copy or a disk, is named and left out, never read as a figure; an
attempt whose `start` is damaged keeps its other lines, on a start rebuilt from the first of them.
The file is appended to where it is: a link, a pipe or a directory in its place is refused (`open_to_append`)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pretraining.files import open_to_append, regular_file

RECORD_FILE = "goodput.jsonl"
# What a process's seconds go to: start-up (from the process's start to the trainer's set-up: imports,
# config, data checks, model); set-up (from there to the first step or validation: the strategy, and in a
# resumed process the checkpoint's restore); training (steps, less the two below); validation; evaluation (the
# downstream tasks some callbacks run in a validation, `SpendsEvaluation`); saving (the steps' waits on
# checkpoint writes); data wait (the training loop's waits on its next batch); other (between the trainer's
# stages, the end of the run). A record of an earlier version has no evaluation: it counts as 0.
SPENT_ON = ("startup", "setup", "training", "validation", "evaluation", "saving", "data_wait", "other")
# Bounds beyond any real run: a value outside them is damage, never a figure (a 1e300 `t` would print as a
# 150-digit count of hours, and a NaN or negative one would undo the budget). A time inside them can still be
# damaged (the year 3300): a line's seconds spent must add up to the time since its attempt started.
LATEST_TIME = 1e11  # seconds: a Unix time before the year 5100, and any duration
MOST_STEPS = 10**15
MOST_DEVICES = 10**7
HIGHEST_PRICE = 1e12
MOST_SHOWN = 5  # damaged lines named in a warning
# How far a line's seconds spent may be from the time since its attempt started: they are summed at every
# logging step, and their float rounding over the longest attempt stays far under this; a damaged time is off by
# more, and at most this much of a line's time is ever counted that did not pass.
SLACK_SECONDS = 1.0

Check = Callable[[Any], bool]


def number(low: float, high: float) -> Check:
    """A JSON number within [low, high]: NaN and the infinities are outside every such range."""
    return lambda value: type(value) in (int, float) and low <= value <= high


def whole(low: int, high: int) -> Check:
    return lambda value: type(value) is int and low <= value <= high


def text(value: Any) -> bool:
    return isinstance(value, str)


def spent(value: Any) -> bool:
    """Seconds by what they went to: a mapping whose known keys are durations (one missing counts 0)."""
    seconds = number(0, LATEST_TIME)
    return isinstance(value, dict) and all(seconds(value[name]) for name in SPENT_ON if name in value)


def nullable(check: Check) -> Check:
    return lambda value: value is None or check(value)


# Each event's fields: (what they must be, whether a line must have them); fields not named are not read.
EVERY_LINE = {
    "attempt": (whole(1, MOST_STEPS), True),
    "t": (number(0, LATEST_TIME), True),
    "step": (whole(0, MOST_STEPS), True),
    "spent": (spent, True),
}
FIELDS: dict[str, dict[str, tuple[Check, bool]]] = {
    "start": {
        "started": (number(0, LATEST_TIME), True),
        "devices": (whole(1, MOST_DEVICES), False),
        "resumed_from": (nullable(whole(0, MOST_STEPS)), False),
        "max_steps": (nullable(whole(-1, MOST_STEPS)), False),
        "device_hour": (nullable(number(0, HIGHEST_PRICE)), False),
        "host": (text, False),
        "device": (text, False),
    },
    "progress": {},
    "validation": {"value": (number(-sys.float_info.max, sys.float_info.max), False)},
    "alert": {"condition": (text, True)},
    "end": {"cause": (text, True)},
}


@dataclass
class Attempt:
    """One process of the run (rank zero's): its `start` line and those it wrote after it."""

    start: dict[str, Any]
    lines: list[dict[str, Any]]
    start_rebuilt: bool = False  # its `start` line is damaged: `start` is rebuilt from its first readable line

    @property
    def number(self) -> int:
        return int(self.start["attempt"])

    @property
    def last(self) -> dict[str, Any]:
        return self.lines[-1] if self.lines else self.start

    @property
    def cause(self) -> str | None:
        """How it ended, from its `end` line; None where it wrote none (killed, or running now)."""
        return self.last.get("cause") if self.last["event"] == "end" else None


@dataclass
class Record:
    """A record read back: its attempts, in order, and its damaged lines (numbered from 1), each with what is wrong."""

    path: Path
    attempts: list[Attempt]
    damaged: dict[int, str]

    def damage(self) -> str | None:
        """The damaged lines in words (None if there are none): which, and the first one's fault."""
        if not self.damaged:
            return None
        numbers = list(self.damaged)
        more = len(numbers) - MOST_SHOWN
        shown = ", ".join(map(str, numbers[:MOST_SHOWN])) + (f" and {more} more" if more > 0 else "")
        return (
            f"{self.path}: {len(numbers)} damaged line(s) left out of the account and the budget (line {shown}; "
            f"line {numbers[0]}: {self.damaged[numbers[0]]}); to start the record afresh, move it aside"
        )


def read_record(path: Path) -> Record:
    """The record at `path` (refused if something other than a file is there), every line checked: a line that is not
    JSON (cut short by a kill), lacks a field, has one of the wrong type or out of range, belongs to no attempt, goes
    back in time or whose seconds spent do not add up to the time passed is damaged, and left out. An attempt whose
    `start` is damaged is kept (`rebuilt_start`). No line makes it raise: a damaged record never stops training."""
    regular_file(path, "the goodput record", "move it aside: the run starts a new record")
    attempts: list[Attempt] = []
    damaged: dict[int, str] = {}
    for index, written in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        line, problem = parsed(written)
        problem = problem or fault(line)
        if not problem and begins_after_a_damaged_start(line, attempts):
            attempts.append(Attempt(rebuilt_start(line), [], start_rebuilt=True))
        problem = problem or fault_after(line, attempts[-1] if attempts else None)
        if problem:
            damaged[index] = problem
        elif line["event"] == "start":
            attempts.append(Attempt(line, []))
        else:
            attempts[-1].lines.append(line)
    most = max((attempt.start.get("devices", 1) for attempt in attempts if not attempt.start_rebuilt), default=1)
    count_rebuilt_starts_on(attempts, most)
    return Record(path, attempts, damaged)


def parsed(line: str) -> tuple[Any, str | None]:
    """A line's JSON value, or what stops it being read."""
    try:
        return json.loads(line), None
    except (ValueError, RecursionError):  # not JSON, an integer of thousands of digits, nesting past the stack
        return None, "not JSON (cut short by a kill?)"


def fault(line: Any) -> str | None:
    """What is wrong with a parsed `line`'s fields, or None."""
    if not isinstance(line, dict) or not isinstance(line.get("event"), str) or line["event"] not in FIELDS:
        return f"not a line of the record (an event: {', '.join(FIELDS)})"
    for name, (check, required) in (EVERY_LINE | FIELDS[line["event"]]).items():
        if name not in line and required:
            return f"no {name!r}"
        if name in line and not check(line[name]):
            return f"its {name!r} is of the wrong type or out of range"
    return None


def seconds_spent(line: dict[str, Any]) -> float:
    return sum(line["spent"].get(name, 0.0) for name in SPENT_ON)


def begins_after_a_damaged_start(line: dict[str, Any], attempts: list[Attempt]) -> bool:
    """Whether a checked `line` is the first readable one of the attempt after the last, whose `start` is damaged.
    Attempts follow one another: one that would have begun before the last one's last line (or before 1970) is a
    damaged line (its attempt number, its seconds), not a new attempt."""
    last = attempts[-1] if attempts else None
    if line["event"] == "start" or line["attempt"] != (last.number if last else 0) + 1:
        return False
    return line["t"] - seconds_spent(line) >= (last.last["t"] if last else 0.0)


def rebuilt_start(line: dict[str, Any]) -> dict[str, Any]:
    """The start of `line`'s attempt, from `line`: it started when the line says its seconds began (the time is its
    own, to a second); its devices, resumed step, host and price are unknown (`count_rebuilt_starts_on`)."""
    started = line["t"] - seconds_spent(line)
    start = {"attempt": line["attempt"], "event": "start", "t": started, "step": 0, "started": started}
    return start | {"spent": dict.fromkeys(SPENT_ON, 0.0)}


def count_rebuilt_starts_on(attempts: list[Attempt], devices: int) -> None:
    """Count each attempt whose start is rebuilt on at least `devices`: the most any readable start of the record
    names, or a restart's own (its devices are the likeliest, and fewer would loosen the budget)."""
    for attempt in attempts:
        if attempt.start_rebuilt:
            attempt.start["devices"] = max(attempt.start.get("devices", 1), devices)


def fault_after(line: dict[str, Any], attempt: Attempt | None) -> str | None:
    """What is wrong with a checked `line` coming after `attempt` (the last one so far), or None."""
    if line["event"] == "start":
        started = line["started"]
    elif attempt is None or line["attempt"] != attempt.number:
        return f"a line of attempt {line['attempt']} out of place (after attempt {attempt.number if attempt else 0})"
    elif line["t"] < attempt.last["t"]:
        return "earlier than the line before it"
    else:
        started = attempt.start["started"]
    if line["t"] < started:
        return "earlier than its attempt's start"
    if abs(seconds_spent(line) - (line["t"] - started)) > SLACK_SECONDS:
        return "its seconds spent do not add up to the time since its attempt started"
    return None


class RecordWriter:
    """Appends lines to a run's record, each flushed as written (a kill loses at most the line being
    written; `read_record` skips it). A write the file system refuses stops the record with a warning, not
    the run."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.length = path, path.stat().st_size if path.is_file() else None
        torn = bool(self.length) and last_byte(path) != b"\n"
        self.file: IO[str] = open_to_append(path, "the goodput record", "move it aside: the run starts a new record")
        if torn:  # the last process died mid-line: this one starts on a line of its own
            self.file.write("\n")

    def write(self, line: dict[str, Any]) -> None:
        if self.file.closed:
            return
        try:
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        except OSError as error:
            warnings.warn(f"{self.file.name}: {error}; the goodput record stops here", stacklevel=2)
            self.file.close()

    def withdraw(self) -> None:
        """Take back every line this writer wrote (a refused start is no attempt): the record as it was found, or
        none if there was none."""
        self.file.close()
        if self.length is None:
            self.path.unlink(missing_ok=True)
        else:
            os.truncate(self.path, self.length)

    def close(self) -> None:
        self.file.close()


def last_byte(path: Path) -> bytes:
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1)
