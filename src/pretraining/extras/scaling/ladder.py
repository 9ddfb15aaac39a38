"""The scaling ladder: train a model at several shapes (width x depth), each for a fixed number of tokens per
parameter (Hoffmann et al. 2022's compute-optimal ratio, 20 by default), fit power laws of the validation loss
against compute and parameters (`power_law`), predict the next, larger rung before it is trained, then train it
and measure the error.

Each rung is a `pretrain` run of its own (`<out>/rungs/<width>x<depth>-<hash of its composed config>`), with every
guarantee of one: the same command again continues an interrupted rung and finds the finished ones finished. The
rung's overrides are the ladder's (`experiment=ladder` unless given) and the user's (`trainer=ddp`,
`data.dir=...`), then its shape, its steps (its tokens over the tokens of a step), a warmup-stable-decay decay over
its last fifth and a validation every fifth.

Parameters are Kaplan et al. 2020's non-embedding count: those of the backbone's layers (no embeddings, head or
final norm); compute is 6 x parameters x tokens."""

from __future__ import annotations

import csv
import ctypes
import hashlib
import io
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from pretraining.checkpoint import read_sidecar, saved_checkpoints
from pretraining.config import CONFIG_DIR
from pretraining.data.batches import global_batch_examples
from pretraining.data.loader import PR_SET_PDEATHSIG
from pretraining.errors import ConfigError, PretrainingError
from pretraining.extras.scaling import power_law
from pretraining.files import write_atomically
from pretraining.instantiate import build
from pretraining.launch import hydra_quote
from pretraining.objectives.base import build_objective
from pretraining.objectives.optimizers import layer_parameters

# The keys the ladder sets for each rung, and those that would end a rung early or move it elsewhere: given by the
# user, they would make the rungs something else.
LADDER_KEYS = (
    "model.backbone.d_model",
    "model.backbone.n_layer",
    "trainer.max_steps",
    "model.decay_steps",
    "trainer.val_check_interval",
    "trainer.max_time",
    "trainer.max_epochs",
    "ckpt_path",
    "paths.output_dir",
    "paths.checkpoint_dir",
)
# Each rung's warmup-stable-decay schedule decays over its last fifth (Hägele et al. 2024's 20 %, which matches a
# cosine run of the same length); a cosine schedule (model.schedule=cosine) decays over the whole rung instead.
DECAY_FRACTION = 0.2
VALIDATIONS = 5  # per rung: its learning curve
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded here, not in a forked child


class LadderError(PretrainingError):
    """A rung that did not finish, or a fit that failed; the message says what to do."""


class LadderStopped(PretrainingError):
    """A signal stopped the ladder (its rung saved first); `status` is the exit status, 128 + the signal's number."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


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
    """Refuse the overrides of the keys the ladder sets or that would cut a rung short, naming what to use."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in LADDER_KEYS or key.startswith("hydra.run.dir"):
            raise ConfigError(
                f"{override}: the ladder sets {key} for each rung, or it would end a rung early or move it (--shapes, "
                "--tokens-per-parameter and --out choose the rungs); leave it out"
            )


def composed(overrides: Sequence[str]) -> DictConfig:
    """`pretrain`'s config under `overrides`, as the run composes it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def plan(shapes: Sequence[tuple[int, int]], tokens_per_parameter: float, overrides: Sequence[str]) -> list[Rung]:
    """The rung of each (width, depth): its model built as the run builds it (on the meta device: no memory, no
    init) to count its parameters, and its steps from the data's tokens per step (without reading the shards)."""
    rungs = []
    for width, depth in shapes:
        cfg = composed([*overrides, f"model.backbone.d_model={width}", f"model.backbone.n_layer={depth}"])
        examples = build(cfg.data.format)(build(cfg.tokenizer))
        with torch.device("meta"):
            parameters = sum(param.numel() for param in layer_parameters(build_objective(cfg.model, examples)))
        step_examples = global_batch_examples(
            cfg.data.global_batch_size, cfg.data.global_batch_tokens, examples.example_tokens
        )
        step_tokens = step_examples * examples.example_tokens
        steps = max(1, round(tokens_per_parameter * parameters / step_tokens))
        rungs.append(Rung(width, depth, parameters, steps, steps * step_tokens))
    return rungs


def shape_overrides(rung: Rung) -> list[str]:
    """What the ladder sets for `rung`: its shape, steps, decay and validations."""
    return [
        f"model.backbone.d_model={rung.width}",
        f"model.backbone.n_layer={rung.depth}",
        f"trainer.max_steps={rung.steps}",
        f"model.decay_steps={max(1, round(DECAY_FRACTION * rung.steps))}",
        f"trainer.val_check_interval={max(1, math.ceil(rung.steps / VALIDATIONS))}",
    ]


def rung_dir(out: Path, rung: Rung, overrides: Sequence[str]) -> Path:
    """`<out>/rungs/<shape>-<hash of its composed config>`: a ladder of other settings (an experiment, a ratio, an
    lr_scale, an edited preset) trains rungs of its own instead of finding these finished."""
    config = OmegaConf.to_yaml(composed([*overrides, *shape_overrides(rung)]), sort_keys=True)
    return out.resolve() / "rungs" / f"{rung.name}-{hashlib.sha256(config.encode()).hexdigest()[:8]}"


def train(rung: Rung, overrides: Sequence[str], out: Path) -> float:
    """Train `rung` (or continue it, or find it finished) in a `pretrain` process; return its final validation
    loss. A stop reaches the run, which saves, and then stops the ladder: Ctrl-C reaches both, SIGTERM is passed
    on, and a ladder killed has the kernel send its rung SIGTERM (Linux)."""
    directory = rung_dir(out, rung, overrides)
    command = [sys.executable, "-m", "pretraining", *overrides, *shape_overrides(rung)]
    command.append(f"hydra.run.dir={hydra_quote(str(directory))}")
    stopped_by: list[int] = []
    with subprocess.Popen(command, preexec_fn=stop_with(os.getpid())) as process:

        def pass_on(signum: int, _: object) -> None:
            stopped_by.append(signum)
            process.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, pass_on)
        try:
            code = process.wait()
        except KeyboardInterrupt:
            stopped_by.append(signal.SIGINT)
            code = process.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if stopped_by:
        name = signal.Signals(stopped_by[0]).name
        raise LadderStopped(
            f"{name} stopped the ladder in rung {rung.name} ({directory}); the same command continues it",
            128 + stopped_by[0],
        )
    if code != 0:
        raise LadderError(
            f"rung {rung.name} ended with exit status {code} (its log: {directory / 'train.log'}): once what stopped "
            "it is fixed, the same command continues the ladder from the rung's last checkpoint"
        )
    return final_loss(directory, rung.steps)


def stop_with(ladder: int) -> Callable[[], None]:
    """What the rung's process runs before it starts: have the kernel send it SIGTERM when the ladder dies (Linux),
    and end it at once if the ladder died before that could be asked."""

    def set_up() -> None:
        if LIBC is not None:
            LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != ladder:
                os._exit(1)

    return set_up


def final_loss(run_dir: Path, steps: int) -> float:
    """The validation loss the rung's checkpoint of its last step records (a finished run's last step is validated)."""
    saved = saved_checkpoints(run_dir / "checkpoints")
    validation = read_sidecar(saved[0][1]).get("validation", {}) if saved and saved[0][0] == steps else {}
    if "val/loss" not in validation:
        raise LadderError(
            f"{run_dir}: no validated checkpoint at the rung's last step, {steps}; its train.log says what stopped it"
        )
    return float(validation["val/loss"])


@dataclass
class Ladder:
    """The rungs fitted and their losses, the rung past them and, once trained, its loss."""

    fitted: list[Rung]
    losses: list[float]
    following: Rung
    measured: float | None = None

    @cached_property
    def fits(self) -> dict[str, power_law.PowerLaw]:
        """The loss against compute and against parameters (of the fitted rungs only: the same once `measured`)."""
        try:
            return {
                "compute": power_law.fit([rung.compute for rung in self.fitted], self.losses),
                "parameters": power_law.fit([rung.parameters for rung in self.fitted], self.losses),
            }
        except (ValueError, RuntimeError) as failed:  # curve_fit gives up with a RuntimeError
            raise LadderError(f"the power law did not fit the rungs' losses {self.losses}: {failed}") from failed

    def prediction(self) -> dict[str, Any]:
        """The next rung's loss as the fit against compute predicts it, with its interval, and as measured."""
        law = self.fits["compute"]
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
    rows, fits = ladder.rows(), {axis: law.record() for axis, law in ladder.fits.items()}
    record = {"settings": settings, "rungs": rows, "fits": fits, "next": ladder.prediction()}
    write_atomically(out / "ladder.json", json.dumps(record, indent=1).encode())
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(out / "ladder.csv", table.getvalue().encode())


def summary(ladder: Ladder) -> list[str]:
    """The rungs, the fits with their exponents' intervals, and the prediction (with its error once measured)."""
    lines = [f"{'rung':12}{'parameters':>12}{'tokens':>13}{'compute':>11}{'val/loss':>10}"]
    for row in ladder.rows():
        loss = "" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        lines.append(f"{row['rung']:12}{row['parameters']:>12,}{row['tokens']:>13,}{row['compute']:>11.3g}{loss:>10}")
    for axis, law in ladder.fits.items():
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
