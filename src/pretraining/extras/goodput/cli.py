"""`pretrain-goodput PATH`: where a run's time and money went across its restarts (PATH a run directory), or
each job's and the share that completed (PATH a sweep's directory). `--json FILE` writes the same as JSON.
Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path


def price(text: str) -> float:
    """`--device-hour`: a finite number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is no price: pass a finite number, 0 or more (such as 2.5)")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-goodput PATH [--device-hour PRICE] [--json FILE]`."""
    parser = argparse.ArgumentParser(
        prog="pretrain-goodput",
        description="A run's wall time, goodput, time lost to restarts, saves, validation and data waits, and "
        "cost, across its restarts; for a sweep's directory, each job's and the share that completed.",
    )
    parser.add_argument("path", type=Path, help="a run directory (logs/train/runs/<name>) or a sweep's")
    parser.add_argument("--device-hour", type=price, help="the price of a device-hour (else the run's own)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    from pretraining.errors import PretrainingError

    try:
        report(args.path, args.device_hour, args.json)
    except (PretrainingError, OSError) as error:  # a record or status that cannot be read, a report not written
        sys.exit(f"pretrain-goodput: {error}")


def report(path: Path, device_hour: float | None, json_path: Path | None) -> None:
    """Print the report of the run or sweep at `path`, and write it to `json_path` if given."""
    from pretraining.extras.goodput.record import RECORD_FILE
    from pretraining.extras.goodput.report import is_run, run_report, sweep_report
    from pretraining.files import regular_file, write_atomically
    from pretraining.run_lock import STATUS_FILE

    if json_path:  # before the work: a directory there would fail the rename at the end
        regular_file(json_path, "--json", "name a file to write the report to")
    if is_run(path):
        text, values = run_report(path, device_hour)
    elif path.is_dir() and any(is_run(job) for job in path.iterdir()):
        text, values = sweep_report(path, device_hour)
    else:
        sys.exit(
            f"pretrain-goodput: {path} is neither a run directory (it holds no {RECORD_FILE}, {STATUS_FILE} "
            "or checkpoints/) nor a sweep's (none of its directories is a run's): pass one, such as "
            "logs/train/runs/<name>"
        )
    print("\n".join(text))
    if json_path:
        write_atomically(json_path, json.dumps(values, indent=2).encode())
        print(f"written: {json_path}")
