"""The records a run keeps beside its checkpoints: a damaged status.json reads `damaged` (every reader goes on, and
the job's next write replaces it), and a record a run appends to is never written through a link nor opened on a
pipe."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

from pretraining.callbacks.numerics import append_line
from pretraining.errors import ConfigError, MissingFileError
from pretraining.job_status import JOB, current_status, read_status, refused_before_work, work_begins
from pretraining.run_lock import STATUS_FILE

DAMAGED = ["{not json", "[1, 2]", '"running"', "{}", '{"status": 3}', "[" * 100_000]


@pytest.mark.parametrize("text", DAMAGED)
def test_a_damaged_status_reads_damaged(tmp_path: Path, text: str) -> None:
    (tmp_path / STATUS_FILE).write_text(text)
    assert read_status(tmp_path) == current_status(tmp_path) == {"status": "damaged"}


@pytest.mark.parametrize("pid", ["abc", None, True, -1, 2**40])
def test_a_running_status_without_a_process_id_reads_damaged(tmp_path: Path, pid: object) -> None:
    record = {"status": "running", "host": socket.gethostname(), **({} if pid is None else {"pid": pid})}
    (tmp_path / STATUS_FILE).write_text(json.dumps(record))
    assert current_status(tmp_path)["status"] == "damaged"


def test_a_status_reads_as_written_unknown_when_absent_and_interrupted_when_its_process_is_gone(tmp_path: Path) -> None:
    assert read_status(tmp_path) == {"status": "unknown"}
    record = {"status": "running", "host": socket.gethostname(), "pid": os.getpid()}
    (tmp_path / STATUS_FILE).write_text(json.dumps(record))
    assert current_status(tmp_path) == record
    (tmp_path / STATUS_FILE).write_text(json.dumps(record | {"pid": 2**31 - 1}))  # above any pid_max Linux allows
    assert current_status(tmp_path)["status"] == "interrupted"


def test_the_loss_spike_record_is_not_appended_through_a_link_nor_opened_on_a_pipe(tmp_path: Path) -> None:
    target, link, pipe = tmp_path / "elsewhere.jsonl", tmp_path / "link.jsonl", tmp_path / "pipe.jsonl"
    target.write_text("")
    link.symlink_to(target)
    os.mkfifo(pipe)
    with pytest.raises(MissingFileError, match="is a symbolic link, not a file"):
        append_line(link, {"step": 1})
    with pytest.raises(MissingFileError, match="is a named pipe, not a file"):
        append_line(pipe, {"step": 1})  # would block until a reader opened it
    assert target.read_text() == ""
    append_line(tmp_path / "spikes.jsonl", {"step": 1})
    assert json.loads((tmp_path / "spikes.jsonl").read_text()) == {"step": 1}


def failed(error: BaseException) -> JobReturn:
    return JobReturn(status=JobStatus.FAILED, _return_value=error)


def test_only_a_refusal_before_the_work_begins_leaves_the_earlier_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(JOB, "work_began", False)
    assert refused_before_work(failed(ConfigError("a bad value")))
    assert not refused_before_work(failed(MemoryError()))  # the run's failure, whenever it happens
    assert not refused_before_work(JobReturn(status=JobStatus.COMPLETED, _return_value=1.0))
    work_begins()
    assert not refused_before_work(failed(ConfigError("a bad value")))
