"""What a run logged, as files read back: its metrics (`csv/metrics.csv`) as series, its command-line
overrides, and the runs under a directory (a multirun's jobs), for plots and sweep reports."""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from omegaconf import OmegaConf

METRICS_FILE = Path("csv") / "metrics.csv"
OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"
NOT_METRICS = {"step", "epoch"}


class PlotError(ValueError):
    """Nothing to plot where we were pointed: no metrics file, or one without metrics."""


class Series(NamedTuple):
    """One metric of one run: the steps it was logged at, ascending, and its value at each."""

    steps: list[int]
    values: list[float]


def read_metrics(path: Path) -> dict[str, Series]:
    """The metrics of a Lightning `metrics.csv`, by name. Rows are sparse (a cell is empty where its
    metric was not logged); where a step appears twice (replayed after a resume), the later row wins."""
    points: dict[str, dict[int, float]] = {}
    rows = 0
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        if not reader.fieldnames:
            raise PlotError(f"{path} is empty: the run has not logged any metrics yet")
        for row in reader:
            rows += 1
            step = parse_number(row.get("step"))
            if step is None:  # a line cut short by a kill in the middle of a write
                continue
            for name, cell in row.items():
                value = parse_number(cell)
                if name is not None and name not in NOT_METRICS and value is not None:
                    points.setdefault(name, {})[int(step)] = value
    if not rows:
        raise PlotError(f"{path} has a header but no rows: the run has not logged any metrics yet")
    return {name: Series(sorted(steps), [steps[s] for s in sorted(steps)]) for name, steps in sorted(points.items())}


def parse_number(cell: str | list[str] | None) -> float | None:
    """A finite float from a CSV cell, or None for an empty or malformed one."""
    if not isinstance(cell, str):  # None: a short row; a list: the surplus cells of a long one
        return None
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # inf would wreck the axis limits; a NaN draws nothing


def find_runs(directory: Path) -> list[Path]:
    """The run directories (holding `csv/metrics.csv`) at or under `directory`, in natural order
    (job 10 after job 9). A run's own subdirectories are not searched."""
    if not directory.is_dir():
        raise PlotError(f"{directory} is not a directory: {expected_input()}")
    runs = []
    for root, subdirs, _ in os.walk(directory):
        if (Path(root) / METRICS_FILE).is_file():
            runs.append(Path(root))
            subdirs.clear()  # its wandb/, checkpoints/ and replaced-*/ are not runs of this directory
        else:
            subdirs[:] = [name for name in subdirs if not name.startswith(".")]
    if not runs:
        raise PlotError(f"no {METRICS_FILE} under {directory}: {expected_input()}")
    return sorted(runs, key=lambda run: natural_key(run.relative_to(directory)))


def expected_input() -> str:
    return (
        "pass a run directory such as logs/train/runs/<run> "
        "or a multirun directory such as logs/train/multiruns/<sweep>"
    )


def natural_key(path: Path) -> list[tuple[int, str]]:
    return [(int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", path.as_posix())]


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """A legend label per run: its path below the directory the runs share (a job's number in a
    multirun, `<sweep>/<job>` across sweeps), and the Hydra overrides (`.hydra/overrides.yaml`) in
    which it differs from the other runs (all of them for a single run)."""
    if len(run_dirs) == 1:
        names = [run_dirs[0].name]
    else:  # distinct directories have distinct paths below their common one: distinct labels
        resolved = [run.resolve() for run in run_dirs]
        common = Path(os.path.commonpath(resolved))
        names = [run.relative_to(common).as_posix() for run in resolved]
    overrides = [read_overrides(run) for run in run_dirs]
    shared = set.intersection(*map(set, overrides)) if len(overrides) > 1 else set()
    labels = []
    for name, own in zip(names, overrides, strict=True):
        differing = [override for override in own if override not in shared]
        labels.append(f"{name}: {' '.join(differing)}" if differing else name)
    return labels


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for a run, or none if it recorded nothing."""
    path = run_dir / OVERRIDES_FILE
    if not path.is_file():
        return []
    return [str(override) for override in OmegaConf.load(path)]
