"""The scaling ladder: train a model at several shapes (width x depth), each for a fixed number of tokens per
parameter (Hoffmann et al. 2022's compute-optimal ratio, 20 by default), fit power laws of the validation loss
against compute and parameters (`power_law`), predict the next, larger rung before it is trained, then train it
and measure the error.

Each rung is a `pretrain` run of its own (`<out>/rungs/<width>x<depth>`), with every guarantee of one: the same
command again continues an interrupted rung and finds the finished ones finished. The rung's overrides are the
ladder's (`experiment=ladder` unless given) and the user's (`trainer=ddp`, `data.dir=...`), then its shape, its
steps (its tokens over the tokens of a step), a warmup-stable-decay decay over its last fifth and a validation
every fifth.

Parameters are Kaplan et al. 2020's non-embedding count: those of the backbone's layers (no embeddings, head or
final norm); compute is 6 x parameters x tokens."""

from __future__ import annotations

import csv
import ctypes
import io
import json
import math
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pretraining.checkpoint import read_sidecar, saved_checkpoints
from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError, PretrainingError
from pretraining.extras.scaling import power_law
from pretraining.files import write_atomically
from pretraining.instantiate import build
from pretraining.launch import hydra_quote
from pretraining.objectives.base import build_objective
from pretraining.objectives.optimizers import layer_parameters

# The keys the ladder sets for each rung: given by the user, they would make the rungs something else.
LADDER_KEYS = (
    "model.backbone.d_model",
    "model.backbone.n_layer",
    "trainer.max_steps",
    "model.decay_steps",
    "trainer.val_check_interval",
)
DECAY_FRACTION = 0.2  # of each rung's steps, the end of its warmup-stable-decay schedule
VALIDATIONS = 5  # per rung: its learning curve
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class LadderError(PretrainingError):
    """A rung that did not finish; the message says how to continue."""


@dataclass(frozen=True)
class Rung:
    """One size of the ladder, as planned: `parameters` non-embedding, `tokens` trained on in `steps` steps."""

    width: int
    depth: int
    parameters: int
    steps: int
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.depth}"

    @property
    def compute(self) -> float:
        """Training FLOPs, 6ND."""
        return 6.0 * self.parameters * self.tokens


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse the overrides of the keys the ladder sets, naming the option that sets them."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in LADDER_KEYS or key.startswith("hydra.run.dir"):
            raise ConfigError(
                f"{override}: the ladder sets {key} for each rung (--shapes, --tokens-per-parameter and --out choose "
                "the rungs); leave it out"
            )


def composed(overrides: Sequence[str]) -> DictConfig:
    """`pretrain`'s config under `overrides`, as the run composes it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def plan(shapes: Sequence[tuple[int, int]], tokens_per_parameter: float, overrides: Sequence[str]) -> list[Rung]:
    """The rung of each (width, depth): its model built as the run builds it, to count its parameters and steps."""
    rungs = []
    for width, depth in shapes:
        cfg = composed([*overrides, f"model.backbone.d_model={width}", f"model.backbone.n_layer={depth}"])
        tokenizer = build(cfg.tokenizer)
        model = build_objective(cfg.model, build(cfg.data, tokenizer=tokenizer).format)
        parameters = sum(param.numel() for param in layer_parameters(model))
        step_tokens = cfg.data.global_batch_tokens or cfg.data.global_batch_size * cfg.data.format.block_size
        steps = max(1, round(tokens_per_parameter * parameters / step_tokens))
        rungs.append(Rung(width, depth, parameters, steps, steps * step_tokens))
    return rungs


def rung_overrides(rung: Rung, overrides: Sequence[str], out: Path) -> list[str]:
    """The `pretrain` overrides of `rung`: the user's, then the ladder's."""
    return [
        *overrides,
        f"model.backbone.d_model={rung.width}",
        f"model.backbone.n_layer={rung.depth}",
        f"trainer.max_steps={rung.steps}",
        f"model.decay_steps={max(1, round(DECAY_FRACTION * rung.steps))}",
        f"trainer.val_check_interval={max(1, math.ceil(rung.steps / VALIDATIONS))}",
        f"hydra.run.dir={hydra_quote(str(rung_dir(out, rung)))}",
    ]


def rung_dir(out: Path, rung: Rung) -> Path:
    return out.resolve() / "rungs" / rung.name


def train(rung: Rung, overrides: Sequence[str], out: Path) -> float:
    """Train `rung` (or continue it, or find it finished) in a `pretrain` process; return its final validation
    loss. A stop reaches the run, which saves and stops, before the ladder ends: Ctrl-C reaches both, SIGTERM is
    passed on, and a ladder killed has the kernel send its rung SIGTERM (Linux)."""
    command = [sys.executable, "-m", "pretraining", *rung_overrides(rung, overrides, out)]
    with subprocess.Popen(command, preexec_fn=stop_with_the_ladder) as process:
        previous = signal.signal(signal.SIGTERM, lambda signum, _: process.send_signal(signum))
        try:
            code = process.wait()
        except KeyboardInterrupt:
            code = process.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if code != 0:
        raise LadderError(
            f"rung {rung.name} ended with exit status {code} (its log: {rung_dir(out, rung) / 'train.log'}); "
            "once what stopped it is fixed, the same command continues the ladder from the rung's last checkpoint"
        )
    return final_loss(rung_dir(out, rung))


def stop_with_the_ladder() -> None:
    """In the rung's process, before it starts: have the kernel send it SIGTERM when the ladder dies."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def final_loss(run_dir: Path) -> float:
    """The validation loss its newest checkpoint records (a finished run's last step is validated)."""
    saved = saved_checkpoints(run_dir / "checkpoints")
    validation = read_sidecar(saved[0][1]).get("validation", {}) if saved else {}
    if "val/loss" not in validation:
        raise LadderError(f"{run_dir}: no validated checkpoint; run the same command again to finish the rung")
    return float(validation["val/loss"])


@dataclass
class Ladder:
    """The rungs fitted and their losses, the rung past them and, once trained, its loss."""

    fitted: list[Rung]
    losses: list[float]
    following: Rung
    measured: float | None = None

    def fits(self) -> dict[str, power_law.PowerLaw]:
        """The loss against compute and against parameters."""
        return {
            "compute": power_law.fit([rung.compute for rung in self.fitted], self.losses),
            "parameters": power_law.fit([rung.parameters for rung in self.fitted], self.losses),
        }

    def prediction(self) -> dict[str, Any]:
        """The next rung's loss as the fit against compute predicts it, with its interval, and as measured."""
        law = self.fits()["compute"]
        predicted = law(self.following.compute)
        return {
            "rung": self.following.name,
            "predicted": predicted,
            "interval": law.interval(self.following.compute),
            "measured": self.measured,
            "error": None if self.measured is None else predicted / self.measured - 1,
        }

    def rows(self) -> list[dict[str, Any]]:
        """One per rung: its plan, its loss and whether the fit used it."""
        rungs = [(rung, loss, True) for rung, loss in zip(self.fitted, self.losses, strict=True)]
        return [
            {"rung": rung.name, **asdict(rung), "compute": rung.compute, "val_loss": loss, "fitted": fitted}
            for rung, loss, fitted in [*rungs, (self.following, self.measured, False)]
        ]


def write(ladder: Ladder, out: Path, settings: dict[str, Any]) -> None:
    """`<out>/ladder.json` (the settings, rungs, fits and prediction) and `<out>/ladder.csv` (the rungs)."""
    fits = {axis: law.record() for axis, law in ladder.fits().items()}
    record = {"settings": settings, "rungs": ladder.rows(), "fits": fits, "next": ladder.prediction()}
    write_atomically(out / "ladder.json", json.dumps(record, indent=1).encode())
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(ladder.rows()[0]))
    writer.writeheader()
    writer.writerows(ladder.rows())
    write_atomically(out / "ladder.csv", table.getvalue().encode())


def summary(ladder: Ladder) -> list[str]:
    """The rungs, the fits with their exponents' intervals, and the prediction (with its error once measured)."""
    lines = [f"{'rung':12}{'parameters':>12}{'tokens':>13}{'compute':>11}{'val/loss':>10}"]
    for row in ladder.rows():
        loss = "" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        lines.append(f"{row['rung']:12}{row['parameters']:>12,}{row['tokens']:>13,}{row['compute']:>11.3g}{loss:>10}")
    for axis, law in ladder.fits().items():
        low, high = law.exponent_interval
        symbol = "C" if axis == "compute" else "N"
        lines.append(
            f"loss against {axis}: {law.irreducible:.4f} + {law.coefficient:.4g} {symbol}^-{law.exponent:.4f} "
            f"(the exponent's {power_law.LEVEL:.0%} interval: {low:.4f} to {high:.4f})"
        )
    prediction, following = ladder.prediction(), ladder.following
    low, high = prediction["interval"]
    times = following.parameters / ladder.fitted[-1].parameters
    lines.append(
        f"{following.name} ({times:.1f}x the largest fitted's parameters): predicted {prediction['predicted']:.4f} "
        f"({power_law.LEVEL:.0%} interval {low:.4f} to {high:.4f})"
    )
    if prediction["measured"] is not None:
        lines.append(f"measured {prediction['measured']:.4f}: the prediction is off by {prediction['error']:+.2%}")
    return lines
