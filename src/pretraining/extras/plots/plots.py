"""Learning curves from the CSV logs: `pretrain-plot RUN_DIR` (or `make plot RUN=...`).

For a run directory (`logs/train/runs/<run>`) it writes `<run>/plots/curves.png`: train and
validation loss, each other metric, tokens/s, data wait, MFU and the learning rate, against the
step. For a directory of runs (a multirun, `logs/train/multiruns/<sweep>`) it writes each run's
figure and `<dir>/plots/overlay.png`, the runs' curves on shared panels.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from pretraining.extras.plots.run_logs import (
    METRICS_FILE,
    NOT_METRICS,
    PlotError,
    Series,
    expected_input,
    find_runs,
    read_metrics,
    run_labels,
)

log = logging.getLogger(__name__)

LOSSES = ("train/loss", "val/loss")
# The throughput metrics worth a panel; the rest (samples/s, per device, step time, memory) repeat them.
PERF_SHOWN = ("perf/tokens_per_s", "perf/data_wait", "perf/mfu")
LINESTYLES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
Color = tuple[float, float, float, float]
MARKERS_UP_TO = 30  # points: sparse series (validation) get markers, so that a single point shows


class Panel(NamedTuple):
    """One subplot: its title and the metrics drawn on it."""

    title: str
    metrics: list[str]


def panels(names: Iterable[str]) -> list[Panel]:
    """The subplots for these metrics: train and validation loss together, one per other `val/`,
    `train/` and `probe/` metric, tokens/s, data wait and MFU, all `lr-*` columns together, one per
    metric of any other prefix. Bookkeeping (`epoch`, `data/*`, the other `perf/*`) is left out."""
    grouped: dict[tuple[int, int, str], list[str]] = {}
    for name in sorted(set(names)):
        key = panel_key(name)
        if key is not None:
            grouped.setdefault(key, []).append(name)
    return [Panel(key[2], grouped[key]) for key in sorted(grouped)]


def panel_key(name: str) -> tuple[int, int, str] | None:
    """Where a metric goes: (group order, order within the group, panel title), or None if nowhere."""
    if name in LOSSES:
        return (0, 0, "loss")
    if name in PERF_SHOWN:
        return (4, PERF_SHOWN.index(name), name)
    if name.startswith("lr-"):  # LearningRateMonitor: lr-<optimizer>, or lr-<optimizer>/pg<N> per group
        return (5, 0, "learning rate")
    if name in NOT_METRICS or name.startswith(("perf/", "data/")):
        return None
    order = {"val": 1, "train": 2, "probe": 3}.get(name.split("/")[0], 6)
    return (order, 0, name)


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw one run's learning curves into `out` (default `<run>/plots/curves.png`); the PNG's path."""
    figure = draw_run(load_run(run_dir), title=str(run_dir))
    return save_png(figure, out or run_dir / "plots" / "curves.png")


def plot_overlay(
    run_dirs: Sequence[Path], out: Path, labels: Sequence[str] | None = None, title: str | None = None
) -> Path:
    """Draw several runs' curves on shared panels, one colour per run, into the PNG `out`; its path.
    `labels` name the runs in the legend (default: `run_labels`), `title` the figure (default: the
    directory the runs share)."""
    if not run_dirs:
        raise PlotError(f"no runs to overlay into {out}")
    labels = list(labels) if labels is not None else run_labels(run_dirs)
    curves = {label: load_run(run) for label, run in zip(labels, run_dirs, strict=True)}
    return save_png(draw_overlay(curves, title=title or os.path.commonpath(run_dirs)), out)


def plot(directory: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the figures for a run directory or a directory of runs (see the module's docstring);
    with `out_dir`, under it instead (`<out_dir>/<run, relative to directory>/curves.png`,
    `<out_dir>/overlay.png`). A run with nothing to plot is left out of a directory of runs, with a
    warning. The paths written."""
    runs = find_runs(directory)
    if runs == [directory]:
        return [plot_run(directory, out_dir / "curves.png" if out_dir else None)]
    written, curves = [], {}
    for run, label in zip(runs, run_labels(runs), strict=True):
        try:
            metrics = load_run(run)
        except PlotError as error:
            log.warning("%s; left out", error)
            continue
        out = out_dir / run.relative_to(directory) / "curves.png" if out_dir else run / "plots" / "curves.png"
        written.append(save_png(draw_run(metrics, title=str(run)), out))
        curves[label] = metrics
    if not curves:
        raise PlotError(f"none of the runs under {directory} has metrics to plot")
    overlay = (out_dir or directory / "plots") / "overlay.png"
    written.append(save_png(draw_overlay(curves, title=str(directory)), overlay))
    return written


def load_run(run_dir: Path) -> dict[str, Series]:
    """A run's metrics, checked to hold at least one that has a panel."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"no {METRICS_FILE} in {run_dir}: {expected_input()}")
    metrics = read_metrics(path)
    if not panels(metrics):
        raise PlotError(f"{path} has no metric to plot (columns: {', '.join(metrics) or 'none with values'})")
    return metrics


def constant(curves: Iterable[Mapping[str, Series]]) -> dict[str, float]:
    """The metrics that held one value at every point of every run (two points at least), by name, with
    that value: a flat line says no more than the value does (`skipped_steps` 0, `probe/majority`).
    None of them if nothing else would be left to draw."""
    values: dict[str, list[float]] = {}
    for metrics in curves:
        for name, series in metrics.items():
            values.setdefault(name, []).extend(series.values)
    flat = {name: points[0] for name, points in values.items() if len(points) > 1 and len(set(points)) == 1}
    return flat if panels(set(values) - set(flat)) else {}


def caption(title: str, flat: Mapping[str, float]) -> str:
    """The figure's title, and a line naming the constant metrics left out."""
    shown = [f"{name} = {value:.4g}" for name, value in sorted(flat.items()) if panel_key(name) is not None]
    return title + ("\nconstant, not drawn: " + ", ".join(shown) if shown else "")


def draw_run(metrics: Mapping[str, Series], title: str) -> Figure:
    """One run's figure: a panel per `panels` entry (constant metrics named in the title instead), a
    legend where a panel has several lines."""
    flat = constant([metrics])
    metrics = {name: series for name, series in metrics.items() if name not in flat}
    layout = panels(metrics)
    figure, axes = new_figure(len(layout), caption(title, flat))
    for ax, panel in zip(axes, layout, strict=True):
        drawn = 0
        for name in distinct(panel.metrics, metrics):
            draw_series(ax, metrics[name], label=name)
            drawn += 1
        ax.set_title(panel.title)
        if drawn > 1:
            ax.legend(fontsize="small")
    return figure


def draw_overlay(curves: Mapping[str, Mapping[str, Series]], title: str) -> Figure:
    """Several runs on shared panels: a colour per run (legend below), a line style per metric of
    a panel (named in its title); a metric with one value in every run is named in the title instead."""
    flat = constant(curves.values())
    layout = panels(set().union(*curves.values()) - set(flat))
    figure, axes = new_figure(len(layout), caption(title, flat))
    colors = run_colors(len(curves))
    for ax, panel in zip(axes, layout, strict=True):
        # A metric's line style is fixed by its place in the panel, so that it is the same for every run.
        styles = {name: list(LINESTYLES)[i % len(LINESTYLES)] for i, name in enumerate(panel.metrics)}
        drawn: set[str] = set()
        for color, metrics in zip(colors, curves.values(), strict=True):
            for name in distinct([name for name in panel.metrics if name in metrics], metrics):
                draw_series(ax, metrics[name], color=color, linestyle=styles[name])
                drawn.add(name)
        names = [name for name in panel.metrics if name in drawn]
        ax.set_title(panel.title if len(names) < 2 else ", ".join(f"{n} {LINESTYLES[styles[n]]}" for n in names))
    handles = [Line2D([], [], color=color, label=label) for color, label in zip(colors, curves, strict=True)]
    # Labels carry overrides and can be long: fewer columns then (the PNG widens to fit, see save_png).
    columns = max(1, min(3, len(handles), 150 // max(len(label) for label in curves)))
    figure.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize="small")
    return figure


def distinct(names: Sequence[str], metrics: Mapping[str, Series]) -> list[str]:
    """`names` without those whose series repeats an earlier one's: lr-AdamW/pg1 and /pg2 (with and
    without weight decay) follow one schedule, and a second line would hide under the first."""
    kept: list[str] = []
    for name in names:
        if all(metrics[name] != metrics[other] for other in kept):
            kept.append(name)
    return kept


def draw_series(
    ax: Axes, series: Series, label: str | None = None, color: Color | None = None, linestyle: str = "-"
) -> None:
    marker = "o" if len(series.steps) <= MARKERS_UP_TO else None
    ax.plot(series.steps, series.values, label=label, color=color, linestyle=linestyle, marker=marker, markersize=3)


def new_figure(count: int, title: str) -> tuple[Figure, list[Axes]]:
    """A figure of `count` panels, three to a row, each with the step as its x axis."""
    columns = min(3, count)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(4.8 * columns, 3.3 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)  # render off-screen, whatever backend pyplot would pick
    grid = figure.subplots(rows, columns, squeeze=False).ravel().tolist()
    for unused in grid[count:]:
        figure.delaxes(unused)
    for ax in grid[:count]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    figure.suptitle(title, fontsize="medium")
    return figure, grid[:count]


def run_colors(count: int) -> list[Color]:
    """Distinct colours for `count` runs: tab10 while it lasts, then evenly along viridis."""
    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    return [colormaps["viridis"](i / (count - 1)) for i in range(count)]


def save_png(figure: Figure, path: Path) -> Path:
    """Write `figure` to `path` as a PNG through a temporary file, so that `path` is never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(temporary, format="png", dpi=100, bbox_inches="tight")  # tight: no legend cut off
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
