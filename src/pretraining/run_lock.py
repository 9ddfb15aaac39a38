"""One job at a time in a run directory: `own_run_directory` takes `flock(LOCK_EX | LOCK_NB)` on `<run dir>/.lock`
and writes the holder's pid, host and start time there. The kernel releases it when the holder dies, even by SIGKILL,
so a stale file never blocks; a refused job raises `RunLockedError` naming the holder. On a shared filesystem it is as
good as its `flock` (NFS: yes; Lustre: mounted with `flock`). Re-entrant within a process: Hydra's job-status
callback and `pretrain`'s `main` both take it (a second `flock` on another open file would refuse the process)."""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pretraining.errors import PretrainingError, RunLockedError

LOCK_FILE = ".lock"
CONFIG_COPIES = ".hydra"  # the job's config as Hydra keeps it (written by job_status.RecordJobStatus)
# A job's directory before its training writes: Hydra's config copies, its `<task_name>.log`, the lock, and the
# job-status record, which counts only if the directory held none of the others' files before this process locked it.
HYDRA_OUTPUT = frozenset({CONFIG_COPIES, LOCK_FILE})
STATUS_FILE = "status.json"
# Our errors that refuse a command: one refused before it trains leaves no run directory behind.
REFUSALS = PretrainingError
# How long a refused job waits for the holder to write its record.
RECORD_WAIT_S = 1.0


@dataclass
class RunLock:
    """The lock this process holds on one run directory."""

    run_dir: Path
    fd: int
    fresh: bool  # the directory held only Hydra's files when this process locked it: this command made it
    depth: int = 1


HELD: dict[Path, RunLock] = {}  # by resolved run directory


def forget_held_locks() -> None:
    """In a forked child (a DataLoader worker), close its copies of the lock files: a flock belongs to the shared
    open file, so a worker outliving a SIGKILLed holder would hold it. Closing, not unlocking, spares the parent's."""
    for lock in HELD.values():
        os.close(lock.fd)
    HELD.clear()


os.register_at_fork(after_in_child=forget_held_locks)


@contextmanager
def own_run_directory(run_dir: Path, *, remove_if_refused: bool = True) -> Iterator[RunLock]:
    """Hold the lock on `run_dir` (made if missing) for the block, or raise `RunLockedError`. If the block raises
    one of `REFUSALS`, with `remove_if_refused`, a directory this command made and holding only Hydra's files is
    removed under the lock. A multirun's job keeps it: its status record is the sweep report's row."""
    lock = acquire(run_dir)
    try:
        yield lock
    except REFUSALS:
        if remove_if_refused:
            remove_if_untouched(lock)
        raise
    finally:
        release(lock)


def acquire(run_dir: Path) -> RunLock:
    key = run_dir.resolve()
    if key in HELD:
        HELD[key].depth += 1
        return HELD[key]
    run_dir.mkdir(parents=True, exist_ok=True)
    fresh = only_hydra_output(run_dir, with_status=False)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLockedError(refusal(run_dir)) from None
    except BaseException:
        os.close(fd)
        raise
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={started}\n".encode(), 0)
    os.fsync(fd)
    HELD[key] = lock = RunLock(key, fd, fresh)
    return lock


def release(lock: RunLock) -> None:
    lock.depth -= 1
    if lock.depth:
        return
    del HELD[lock.run_dir]
    fcntl.flock(lock.fd, fcntl.LOCK_UN)
    os.close(lock.fd)  # the file stays: a lock file nobody holds blocks nobody


def holder(run_dir: Path) -> dict[str, str]:
    """The record the holder of `run_dir`'s lock wrote (pid, host, started); empty if there is none yet."""
    try:
        text = (run_dir / LOCK_FILE).read_text()
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def refusal(run_dir: Path) -> str:
    deadline = time.monotonic() + RECORD_WAIT_S
    record = holder(run_dir)
    while not record.keys() >= {"pid", "host", "started"} and time.monotonic() < deadline:
        time.sleep(0.05)  # the holder has the lock but has not written its record yet
        record = holder(run_dir)
    who = (
        f"process {record['pid']} on {record['host']}, started {record['started']}"
        if record.keys() >= {"pid", "host", "started"}
        else "another process"
    )
    return (
        f"The run directory {run_dir} is in use by {who}: one job at a time writes a run. "
        "Wait for it to finish (running the same command then continues the run), "
        "or pass run_name=<another name> to start a separate run."
    )


def only_hydra_output(run_dir: Path, *, with_status: bool) -> bool:
    """Whether `run_dir` holds nothing but what Hydra writes for a command (and `status.json` if `with_status`)."""
    return all(is_job_file(entry, with_status=with_status) for entry in run_dir.iterdir())


def is_job_file(entry: Path, *, with_status: bool = True) -> bool:
    """Whether `entry` of a run directory is the job's own (Hydra's config copies and log, the lock, and with
    `with_status` the status record), not the run's output."""
    allowed = HYDRA_OUTPUT | ({STATUS_FILE} if with_status else set())
    return entry.name in allowed or (entry.suffix == ".log" and entry.is_file())


def remove_if_untouched(lock: RunLock) -> None:
    # Only a directory this command made, holding nothing of a run (checkpoint, metric, earlier status or log).
    if lock.fresh and lock.run_dir.is_dir() and only_hydra_output(lock.run_dir, with_status=True):
        shutil.rmtree(lock.run_dir, ignore_errors=True)
