"""The registry's storage: an append-only JSON-lines file, one event per line, fsynced.

Why not SQLite: its WAL mode needs memory shared between the processes of one host, so a registry on
a network filesystem (NFS, Lustre) shared by several machines would be unsafe, and its file is opaque.
A line log works wherever `flock` does (the same guarantee as the run lock), reads with any tool, and
is its own audit trail: nothing is ever rewritten. Each writer holds an exclusive `flock` on
`ledger.lock` while it reads the events, decides and appends, so two processes never give out the
same version number or lose an event. A writer killed mid-append leaves a last line without its
newline, never acknowledged: readers skip it, and the next writer cuts it off before appending.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pretraining.errors import ConfigError
from pretraining.files import fsync_directory

LEDGER_FILE = "ledger.jsonl"
LOCK_FILE = "ledger.lock"
Event = dict[str, Any]


class Ledger:
    """The events of the registry in `directory`, in the order they were written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEDGER_FILE

    def events(self) -> list[Event]:
        """Every complete event (a torn last line, from a writer killed mid-append, is not one)."""
        return self.read()[0]

    def read(self) -> tuple[list[Event], int]:
        """The complete events, and the length of the file up to the end of the last one."""
        if not self.path.is_file():
            return [], 0
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        events = []
        for number, line in enumerate(complete.splitlines(), 1):
            try:
                events.append(json.loads(line))
            except ValueError:
                raise ConfigError(
                    f"line {number} of the registry ledger {self.path} is not JSON: the file was edited by hand; "
                    "restore it from a backup (the registry only ever appends to it)"
                ) from None
        return events, len(complete)

    def append(self, decide: Callable[[list[Event]], list[Event]]) -> list[Event]:
        """Under the lock: pass the current events to `decide`, append the events it returns (fsynced), and
        return them."""
        with self.locked():
            events, complete = self.read()
            new = decide(events)
            if new:
                lines = b"".join(json.dumps(event, sort_keys=True).encode() + b"\n" for event in new)
                created = not self.path.exists()
                with self.path.open("ab") as file:
                    file.truncate(complete)  # a torn line of a killed writer goes
                    file.write(lines)
                    file.flush()
                    os.fsync(file.fileno())
                if created:
                    fsync_directory(self.directory)
            return new

    def check_writable(self) -> None:
        """Refuse a registry this process cannot write to, naming the fix."""
        os.close(self.open_lock())

    def open_lock(self) -> int:
        """The lock file, open for writing (created with its directory if need be); refused with the fix."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ConfigError(
                f"cannot write to the registry directory {self.directory} ({error.strerror}): pass a writable one "
                "with --registry DIR (or paths.registry_dir=DIR)"
            ) from None

    @contextmanager
    def locked(self) -> Iterator[None]:
        fd = self.open_lock()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock
