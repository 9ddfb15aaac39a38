"""`pretrain-goodput`'s work: a run's account, or a sweep's jobs', in words and as JSON values."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pretraining.extras.goodput.account import account_run, amount, hours, lines
from pretraining.extras.goodput.record import RECORD_FILE, read_record
from pretraining.job_status import current_status
from pretraining.run_lock import STATUS_FILE


def is_run(path: Path) -> bool:
    return any((path / name).exists() for name in (RECORD_FILE, STATUS_FILE, "checkpoints"))


def run_status(run: Path) -> str:
    """The run's status (`current_status`: a `running` one whose process is gone reads `interrupted`)."""
    status = str(current_status(run)["status"])
    return f"unknown ({STATUS_FILE} is damaged)" if status == "damaged" else status


def run_report(run: Path, device_hour: float | None) -> tuple[list[str], dict[str, Any]]:
    """A run's account in words and as JSON values; for a run without a record, what it cannot account for."""
    status = run_status(run)
    if not (run / RECORD_FILE).exists():
        note = (
            f"{run} has no {RECORD_FILE}: the run's time, restarts and cost cannot be accounted for (it ran "
            "without the goodput extra, or with callbacks=none, or before version 0.9.1)"
        )
        return [f"{run}: {status}", f"not accounted for: {note}"], {"status": status, "unaccounted": [note]}
    record = read_record(run / RECORD_FILE)
    damage = record.damage()
    account = account_run(record.attempts, device_hour, [damage] if damage else [])
    return [f"{run}: {status}", *lines(account)], {"status": status} | account.as_dict()


def sweep_report(sweep: Path, device_hour: float | None) -> tuple[list[str], dict[str, Any]]:
    """Each job's status, goodput and cost, and the share of jobs that completed."""
    jobs = sorted((job for job in sweep.iterdir() if is_run(job)), key=lambda job: (len(job.name), job.name))
    reports = [run_report(job, device_hour)[1] | {"job": job.name} for job in jobs]
    statuses = Counter(report["status"] for report in reports)
    rate = statuses["completed"] / len(reports)
    counts = ", ".join(f"{status}: {count}" for status, count in statuses.items())
    text = [f"{sweep}: {len(reports)} jobs, {rate:.0%} completed ({counts})"]
    for report in reports:
        if "goodput" not in report:
            text.append(f"  {report['job']}: {report['status']}, no {RECORD_FILE}")
            continue
        cost = "" if report["cost"] is None else f", cost {amount(report['cost'])}"
        text.append(
            f"  {report['job']}: {report['status']}, step {report['step']}, {hours(report['wall_seconds'])}, goodput "
            f"{report['goodput']:.1%}, {report['restarts']} restart(s){cost}"
        )
    return text, {"jobs": reports, "success_rate": rate, "statuses": dict(statuses)}
