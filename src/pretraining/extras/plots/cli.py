"""`pretrain-plot RUN_DIR`: learning curves as PNG. Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pretraining.errors import MissingExtraError


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-plot RUN_DIR`: learning curves as PNG."""
    parser = argparse.ArgumentParser(prog="pretrain-plot", description="Learning curves from the CSV logs, as PNG.")
    parser.add_argument(
        "run_dir",
        type=Path,
        help="a run directory (logs/train/runs/<run>) or a directory of runs (logs/train/multiruns/<sweep>)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write the figures under this directory instead of each run's plots/"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(format="pretrain-plot: %(message)s")
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit(f"pretrain-plot: {MissingExtraError('drawing learning curves (matplotlib)', 'plots')}")
    from pretraining.extras.plots.plots import plot
    from pretraining.extras.plots.run_logs import PlotError

    try:
        written = plot(args.run_dir, args.out)
    except PlotError as error:
        sys.exit(f"pretrain-plot: {error}")
    for path in written:
        print(path)
