"""The coordinate check's figure, as µP papers draw it: per parametrization, the activation sizes against width
(or depth) on log axes, one line per layer, after the last step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pretraining.extras.plots.plots import save_png
from pretraining.extras.scaling.coordinates import SHOWN, Coordinate


def coordinate_figure(checks: Mapping[str, Sequence[Coordinate]], along: str, title: str, out: Path) -> None:
    """One panel per parametrization (`checks`: its records), written to `out` (a PNG)."""
    figure = Figure(figsize=(4.2 * len(checks), 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, len(checks), sharey=True, squeeze=False)[0]  # one scale: flat against growing
    for axes, (name, records) in zip(panels, checks.items(), strict=True):
        last = max(record.step for record in records)
        for layer in SHOWN:
            points = sorted((getattr(r, along), r.size) for r in records if r.layer == layer and r.step == last)
            axes.plot(*zip(*points, strict=True), marker="o", label=layer)
        axes.set_xscale("log", base=2)
        axes.set(yscale="log", xlabel=along, title=f"{name}, step {last}")
        axes.minorticks_off()
        axes.set_xticks(sorted({getattr(r, along) for r in records}))
        axes.xaxis.set_major_formatter("{x:g}")
    figure.axes[0].set_ylabel("mean |activation|")
    figure.axes[-1].legend(fontsize="small")
    figure.suptitle(title)
    save_png(figure, out)
