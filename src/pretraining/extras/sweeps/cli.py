"""`pretrain-sweep-report SWEEP_DIR`: a sweep's jobs ranked. Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-sweep-report SWEEP_DIR`: a sweep's jobs ranked."""
    parser = argparse.ArgumentParser(
        prog="pretrain-sweep-report", description="A sweep's jobs ranked, as report.md, report.csv and an overlay plot."
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory, such as logs/train/multiruns/<sweep>")
    args = parser.parse_args(argv)
    logging.basicConfig(format="pretrain-sweep-report: %(message)s")
    from pretraining.extras.plots.run_logs import PlotError
    from pretraining.extras.sweeps.report import SweepError, write_report

    try:
        write_report(args.sweep_dir)
    except (SweepError, PlotError) as error:
        sys.exit(f"pretrain-sweep-report: {error}")
    print((args.sweep_dir / "report.md").read_text(), end="")
    print(f"written: {args.sweep_dir / 'report.md'}, {args.sweep_dir / 'report.csv'}")
