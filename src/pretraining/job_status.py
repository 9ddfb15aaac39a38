"""Every job's outcome in `<run dir>/status.json`, written by a Hydra callback (configs/hydra/default.yaml): `running`
at the start, then `completed` (with the sweeper's value), `failed` (with the error), or `stopped` before
`trainer.max_steps` (`record_stop`). Schedulers, people and the sweeps extra read it. The callback also writes the
`.hydra/` config copies (`hydra.output_subdir` is null, so Hydra would write them before any lock), under the lock.
A job that ends before its work begins (`work_begins`: a refused re-run of a finished run) puts back the records of
the run it found, as they were."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pretraining.errors import PretrainingError, RunLockedError
from pretraining.files import write_atomically
from pretraining.internals import failed_job_error
from pretraining.launch import is_rank_zero_process
from pretraining.run_lock import CONFIG_COPIES, STATUS_FILE, RunLock, acquire, release


class RecordJobStatus(Callback):
    """Record each job's config in `<job>/.hydra/` and its outcome in `<job>/status.json` (rank zero only)."""

    # Written under the job's lock (`pretraining.run_lock`, which `pretrain` holds too): a job refused a directory
    # in use neither rewrites its records nor marks it failed, nor remakes a refused command's removed directory.
    lock: RunLock | None = None

    def __init__(self) -> None:
        self.found: dict[Path, bytes] = {}  # the records of the run in the job's directory when the job started

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not is_rank_zero_process():
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        try:
            self.lock = acquire(job_dir)
        except RunLockedError:  # the job itself stops with it
            return
        JOB.work_began = False
        self.found = run_records(job_dir)
        save_job_config(job_dir, config)
        write_status(
            job_dir, {"status": "running", "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        )

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not is_rank_zero_process():
            return
        lock, self.lock = self.lock, None
        if lock is None:  # refused: the directory is another job's
            return
        try:
            job_dir = Path(config.hydra.runtime.output_dir)
            if refused_before_work(job_return) and Path(STATUS_FILE) in self.found:
                put_back(job_dir, self.found)  # refused before touching the run: its record stays the run's
            elif job_dir.is_dir():
                record = read_status(job_dir)
                ended = outcome(job_return)
                if record["status"] == "stopped" and ended["status"] == "completed":
                    ended["status"] = "stopped"  # before trainer.max_steps: the run recorded why (`record_stop`)
                write_status(job_dir, {**record, **ended, "finished": time.time()})
        finally:
            release(lock)


class Job:
    """This process's job (with Hydra's basic launcher a multirun's jobs share one process, one after another)."""

    work_began = False  # the job passed its checks and works on the run (`work_begins`)


JOB = Job()


def work_begins() -> None:
    """Say that the job passed its checks and now works on its run (`pretraining.train`): from here its failure is
    the run's, recorded as `failed`; before, a refusal leaves an earlier run's records as found."""
    JOB.work_began = True


def refused_before_work(job_return: JobReturn) -> bool:
    """Whether the job was refused (one of the template's errors) before its work began; an error of another kind
    (out of memory, an import) is the run's failure whenever it happens."""
    if job_return.status == JobStatus.COMPLETED or JOB.work_began:
        return False
    return isinstance(failed_job_error(job_return), PretrainingError)


def run_records(job_dir: Path) -> dict[Path, bytes]:
    """The status record and config copies in `job_dir` (by relative path), as bytes; none in a new directory."""
    paths = [job_dir / STATUS_FILE, *sorted((job_dir / CONFIG_COPIES).glob("*"))]
    return {path.relative_to(job_dir): path.read_bytes() for path in paths if path.is_file()}


def put_back(job_dir: Path, records: dict[Path, bytes]) -> None:
    """Write `run_records`' records back into `job_dir`, as they were."""
    for name, content in records.items():
        write_atomically(job_dir / name, content)


def save_job_config(job_dir: Path, config: DictConfig) -> None:
    """Hydra's copies of a job's config, as it writes them: `.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`."""
    copies = {
        "config.yaml": OmegaConf.masked_copy(config, [str(key) for key in config if key != "hydra"]),
        "hydra.yaml": OmegaConf.masked_copy(config, ["hydra"]),
        "overrides.yaml": config.hydra.overrides.task,
    }
    (job_dir / CONFIG_COPIES).mkdir(parents=True, exist_ok=True)
    for name, part in copies.items():
        write_atomically(job_dir / CONFIG_COPIES / name, OmegaConf.to_yaml(part).encode())


def outcome(job_return: JobReturn) -> dict[str, Any]:
    """`completed` with the value the job returned (a number, for a sweeper), or `failed` with its error."""
    if job_return.status != JobStatus.COMPLETED:
        error = failed_job_error(job_return)
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    value = job_return.return_value
    return {"status": "completed", "value": float(value) if isinstance(value, int | float) else None}


def record_stop(job_dir: Path, step: int, stopped_by: str) -> None:
    """Record that the run stopped at `step`, before `trainer.max_steps`, and by what (`SIGTERM`, `trainer.max_time`):
    a job exiting with a signal's status never reaches `on_job_end`, so this is its last record."""
    record = read_status(job_dir)
    if record["status"] != "unknown":  # only where a job-status callback keeps a record
        write_status(job_dir, {**record, "status": "stopped", "step": step, "stopped_by": stopped_by})


def read_status(job_dir: Path) -> dict[str, Any]:
    """The job's status record as written; `unknown` where it has none, `damaged` where it is no record with a status
    (a torn copy, a user's edit): readers go on, and the job's next write replaces it."""
    path = job_dir / STATUS_FILE
    if not path.is_file():
        return {"status": "unknown"}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {"status": "damaged"}
    return record if isinstance(record, dict) and isinstance(record.get("status"), str) else {"status": "damaged"}


def current_status(job_dir: Path) -> dict[str, Any]:
    """The job's status record for a reader: `running` whose process is gone from this host reads `interrupted`."""
    record = read_status(job_dir)
    if record["status"] == "running":
        pid = record.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
            record["status"] = "damaged"
        elif record.get("host") == socket.gethostname() and not alive(pid):
            record["status"] = "interrupted"
    return record


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds that id now
        pass
    return True


def write_status(job_dir: Path, record: dict[str, Any]) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(job_dir / STATUS_FILE, json.dumps(record, indent=2).encode())
