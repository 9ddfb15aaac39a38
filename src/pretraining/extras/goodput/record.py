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
stops at its last line, at most a heartbeat before it died. A line cut short by such a kill is skipped when
read."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

RECORD_FILE = "goodput.jsonl"
# What a process's seconds go to: start-up (from the process's start to the trainer's set-up: imports,
# config, data checks, model); set-up (from there to the first step or validation: the strategy, and in a
# resumed process the checkpoint's restore); training (steps, less the two below); validation; saving (the
# steps' waits on checkpoint writes); data wait (the training loop's waits on its next batch); other (between
# the trainer's stages, the end of the run).
SPENT_ON = ("startup", "setup", "training", "validation", "saving", "data_wait", "other")


@dataclass
class Attempt:
    """One process of the run (rank zero's): its `start` line and those it wrote after it."""

    start: dict[str, Any]
    lines: list[dict[str, Any]]

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


def read_attempts(path: Path) -> tuple[list[Attempt], int]:
    """The attempts recorded in `path`, in order, and the number of lines skipped as unreadable (cut short
    by a kill). Lines before the first `start` belong to no attempt and are skipped too."""
    attempts: list[Attempt] = []
    skipped = 0
    for text in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if not isinstance(line, dict) or "event" not in line:
            skipped += 1
        elif line["event"] == "start":
            attempts.append(Attempt(line, []))
        elif attempts and line.get("attempt") == attempts[-1].number:
            attempts[-1].lines.append(line)
        else:
            skipped += 1
    return attempts, skipped


class RecordWriter:
    """Appends lines to a run's record, each flushed as written (a kill loses at most the line being
    written; `read_attempts` skips it). A write the file system refuses stops the record with a warning, not
    the run."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = path.is_file() and path.stat().st_size > 0 and last_byte(path) != b"\n"
        self.file: IO[str] = path.open("a")
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

    def close(self) -> None:
        self.file.close()


def last_byte(path: Path) -> bytes:
    with path.open("rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1)
