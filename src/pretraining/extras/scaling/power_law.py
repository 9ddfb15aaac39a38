"""A power law with an irreducible loss, `y = irreducible + coefficient * x ** -exponent` (Hoffmann et al. 2022's
form in one variable: compute, or parameters at a fixed ratio of tokens), fitted by least squares, with Student's t
intervals from the fit's covariance: the exponent's, and a prediction interval for a new point (the delta method,
plus the scatter of the points about the curve). The irreducible term lets the curve bend: a small ladder's rungs
flatten as they grow, and a straight line on log-log axes through them predicts too low past them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
from scipy import optimize, stats

LEVEL = 0.95
FREE_PARAMETERS = 3  # the law's: irreducible, coefficient, exponent


@dataclass(frozen=True)
class PowerLaw:
    """The fit of `points` points: its parameters, their covariance (of irreducible, coefficient at x = `scale`,
    exponent) and `scatter`, the residuals' standard deviation."""

    level: ClassVar[float] = LEVEL  # of its intervals
    irreducible: float
    coefficient: float  # y - irreducible = coefficient * x ** -exponent, in x's own units
    exponent: float
    exponent_interval: tuple[float, float]
    scatter: float
    points: int
    scale: float  # the smallest x: the fit's unit, for its conditioning
    covariance: list[list[float]]

    def __call__(self, x: float) -> float:
        return self.irreducible + self.coefficient * x**-self.exponent

    def interval(self, x: float) -> tuple[float, float]:
        """The LEVEL prediction interval of a new point at `x`."""
        scaled = (x / self.scale) ** -self.exponent
        reducible = self.coefficient * self.scale**-self.exponent  # the coefficient at x = scale
        gradient = np.array([1.0, scaled, -reducible * scaled * math.log(x / self.scale)])
        variance = gradient @ np.array(self.covariance) @ gradient + self.scatter**2
        half = quantile(self.points) * math.sqrt(variance)
        return self(x) - half, self(x) + half

    def record(self) -> dict[str, Any]:
        """The fit as JSON takes it: a covariance curve_fit could not estimate (infinite) as null."""
        record = asdict(self)
        record["covariance"] = [[c if math.isfinite(c) else None for c in row] for row in self.covariance]
        return record


def quantile(points: int) -> float:
    """Student's t quantile of the two-sided LEVEL interval, at the fit's degrees of freedom."""
    return float(stats.t.ppf((1 + LEVEL) / 2, points - FREE_PARAMETERS))


def fit(x: Sequence[float], y: Sequence[float]) -> PowerLaw:
    """The law through (x, y): four points or more (one more than its parameters), all positive, at distinct x."""
    if len(x) != len(y) or len(x) <= FREE_PARAMETERS or min(*x, *y) <= 0 or len(set(x)) < len(x):
        raise ValueError(f"a power law needs four positive points or more at distinct x: x={list(x)}, y={list(y)}")
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    scale = float(xs.min())

    def law(at: np.ndarray, irreducible: float, reducible: float, exponent: float) -> np.ndarray:
        return irreducible + reducible * (at / scale) ** -exponent

    start = (ys.min() / 2, ys.max() - ys.min() / 2, 0.2)
    bounds = ([0.0, 0.0, 0.0], [ys.min(), np.inf, 10.0])
    (irreducible, reducible, exponent), covariance = optimize.curve_fit(law, xs, ys, start, bounds=bounds)
    residuals = ys - law(xs, irreducible, reducible, exponent)
    scatter = math.sqrt(float(residuals @ residuals) / (len(xs) - FREE_PARAMETERS))
    # curve_fit scales the covariance by the residuals' variance (absolute_sigma=False): of the same scatter.
    half = quantile(len(xs)) * math.sqrt(covariance[2, 2])
    return PowerLaw(
        irreducible=float(irreducible),
        coefficient=float(reducible * scale**exponent),
        exponent=float(exponent),
        exponent_interval=(float(exponent - half), float(exponent + half)),
        scatter=scatter,
        points=len(xs),
        scale=scale,
        covariance=covariance.tolist(),
    )
