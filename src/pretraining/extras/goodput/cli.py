"""`pretrain-goodput PATH`: where a run's time and money went across its restarts (PATH a run directory), or
each job's and the share that completed (PATH a sweep's directory). `--json FILE` writes the same as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretraining.extras.goodput.account import account_run, hours, lines
from pretraining.extras.goodput.record import RECORD_FILE, read_attempts
from pretraining.files import write_atomically
from pretraining.job_status import read_status
from pretraining.run_lock import STATUS_FILE


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-goodput PATH [--device-hour PRICE] [--json FILE]`."""
    parser = argparse.ArgumentParser(
        prog="pretrain-goodput",
        description="A run's wall time, goodput, time lost to restarts, saves, validation and data waits, and "
        "cost, across its restarts; for a sweep's directory, each job's and the share that completed.",
    )
    parser.add_argument("path", type=Path, help="a run directory (logs/train/runs/<name>) or a sweep's")
    parser.add_argument("--device-hour", type=float, help="the price of a device-hour (else the run's own)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.device_hour is not None and args.device_hour < 0:
        sys.exit(f"pretrain-goodput: --device-hour={args.device_hour} is negative: pass a price of 0 or more")
    if is_run(args.path):
        text, report = run_report(args.path, args.device_hour)
    elif args.path.is_dir() and any(is_run(job) for job in args.path.iterdir()):
        text, report = sweep_report(args.path, args.device_hour)
    else:
        sys.exit(
            f"pretrain-goodput: {args.path} is neither a run directory (it holds no {RECORD_FILE}, {STATUS_FILE} "
            "or checkpoints/) nor a sweep's (none of its directories is a run's): pass one, such as "
            "logs/train/runs/<name>"
        )
    print("\n".join(text))
    if args.json:
        write_atomically(args.json, json.dumps(report, indent=2).encode())
        print(f"written: {args.json}")


def is_run(path: Path) -> bool:
    return any((path / name).exists() for name in (RECORD_FILE, STATUS_FILE, "checkpoints"))


def run_report(run: Path, device_hour: float | None) -> tuple[list[str], dict[str, Any]]:
    """A run's account in words and as JSON values; for a run without a record, what it cannot account for."""
    status = read_status(run)["status"]
    if not (run / RECORD_FILE).is_file():
        note = (
            f"{run} has no {RECORD_FILE}: the run's time, restarts and cost cannot be accounted for (it ran "
            "without the goodput extra, or with callbacks=none, or before version 0.10)"
        )
        return [f"{run}: {status}", f"not accounted for: {note}"], {"status": status, "unaccounted": [note]}
    attempts, skipped = read_attempts(run / RECORD_FILE)
    notes = [f"{skipped} unreadable line(s) of {RECORD_FILE} skipped (cut short by a kill)"] if skipped else []
    account = account_run(attempts, device_hour, notes)
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
        cost = "" if report["cost"] is None else f", cost {report['cost']:.2f}"
        text.append(
            f"  {report['job']}: {report['status']}, step {report['step']}, {hours(report['wall_seconds'])}, goodput "
            f"{report['goodput']:.1%}, {report['restarts']} restart(s){cost}"
        )
    return text, {"jobs": reports, "success_rate": rate, "statuses": dict(statuses)}
