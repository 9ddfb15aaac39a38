"""The coordinate check's figure, as µP papers draw it: per parametrization, the activation sizes against width
(or depth) on log axes, one line per layer, after the last step; and the scaling ladder's fits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pretraining.extras.plots.plots import save_png
from pretraining.extras.scaling.coordinates import SHOWN, Coordinate

if TYPE_CHECKING:  # the ladder's fits need scipy, which the coordinate check's figure does not
    from pretraining.extras.scaling.ladder import Ladder


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


def ladder_figure(ladder: Ladder, out: Path) -> None:
    """The validation loss against compute and against parameters on log axes: the fitted rungs, each fit extended
    to the next rung with its prediction interval, and the next rung as measured."""
    figure = Figure(figsize=(9, 3.8), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(1, 2, sharey=True)
    for axes, (axis, law) in zip(panels, ladder.fits.items(), strict=True):
        coordinate = attrgetter(axis)
        xs = np.geomspace(coordinate(ladder.fitted[0]), coordinate(ladder.following), 50)
        low, high = zip(*map(law.interval, xs), strict=True)
        axes.fill_between(xs, low, high, alpha=0.2, label=f"{law.level:.0%} prediction interval")
        axes.plot(xs, [law(x) for x in xs], label=f"fit: exponent {law.exponent:.3f}")
        axes.plot([coordinate(r) for r in ladder.fitted], ladder.losses, "o", label="rungs fitted")
        following = coordinate(ladder.following)
        axes.plot([following], [law(following)], "x", markersize=9, label="predicted")
        if ladder.measured is not None:
            measured = f"{ladder.following.name}, measured"
            axes.plot([following], [ladder.measured], "*", markersize=12, label=measured)
        axes.set(xscale="log", yscale="log", xlabel="FLOPs (6ND)" if axis == "compute" else "parameters (N)")
        axes.yaxis.set_major_formatter("{x:g}")
        axes.yaxis.set_minor_formatter("{x:.1f}")
    panels[0].set_ylabel("validation loss")
    panels[0].legend(fontsize="small")
    figure.suptitle("The scaling ladder: the next rung's loss, predicted and measured")
    save_png(figure, out)
