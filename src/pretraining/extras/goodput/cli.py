"""`pretrain-goodput PATH`: where a run's time and money went across its restarts (PATH a run directory), or
each job's and the share that completed (PATH a sweep's directory). `--json FILE` writes the same as JSON.
Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


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
    from pretraining.extras.goodput.record import RECORD_FILE
    from pretraining.extras.goodput.report import is_run, run_report, sweep_report
    from pretraining.files import write_atomically
    from pretraining.run_lock import STATUS_FILE

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
