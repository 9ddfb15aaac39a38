"""The end of a training run, for `pretraining.train`: the summary, then the exit status of a run a signal stopped.
Callbacks take part through two protocols: `StopsTraining` (says why it stopped training) and `HearsTheRunEnd` (adds
summary lines: the goodput extra's cost line)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities import rank_zero_info

from pretraining.callbacks.checkpoint import early_stopped
from pretraining.callbacks.preemption import stop_signal
from pretraining.job_status import record_stop
from pretraining.launch import hydra_quote
from pretraining.loggers import ResumableCSVLogger, WandbRunLogger


@runtime_checkable
class StopsTraining(Protocol):
    """A callback that may stop training before `trainer.max_steps`; once it has, `stop_reason` says why and how to go
    on (DataCounts: a source ran out; a budget)."""

    stop_reason: str | None


@runtime_checkable
class HearsTheRunEnd(Protocol):
    """A callback told the run is over (`stopped_by`: `stop_cause`'s words, or None) before the summary; it returns
    lines for it."""

    def on_run_end(self, trainer: Trainer, stopped_by: str | None) -> list[str]: ...


def report(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Print the run directory, its last checkpoint with the commands for it (and the extras a fork keeps), the final
    metrics and how to upload an offline W&B run; after a signal, exit 128 + its number (having saved)."""
    run = shown(Path(trainer.default_root_dir))
    lines = [f"run directory: {run}"]
    last = getattr(trainer.checkpoint_callback, "last_model_path", "")
    if last and Path(last).exists():
        last = shown(Path(last))
        lines += [
            f"last checkpoint: {last}",
            f"  evaluate it:    {command('pretrain-eval', f'ckpt_path={override_value(last)}')}",
            f"  what made it:   {command('pretrain-info', last)}",
        ]
        if has_extra("hf"):
            lines.append(f"  export it:      {command('pretrain-export', last, Path('exports') / export_name(run))}")
    if has_extra("plots") and any(isinstance(logger, ResumableCSVLogger) for logger in trainer.loggers):
        lines.append(f"learning curves: {command('pretrain-plot', run)}")
    lines += [
        f"{name} = {value:.0f}" if value.is_integer() else f"{name} = {value:.5g}"
        for name, value in sorted(metrics.items())
    ]
    syncs = [logger.sync_command() for logger in trainer.loggers if isinstance(logger, WandbRunLogger)]
    if any(syncs):
        hint = next(filter(None, syncs))
        lines.append(f"W&B logged offline (no credentials, or WANDB_MODE=offline); upload the run with: {hint}")
    stopped_by = stop_cause(trainer)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, HearsTheRunEnd):
            lines += callback.on_run_end(trainer, stopped_by)
    rank_zero_info("\n".join(lines))
    if stopped_by:
        at = f"at step {trainer.global_step} of trainer.max_steps={trainer.max_steps}"
        if stopped_by == callback_stop(trainer):  # a callback's words, which say how to go on (or not to)
            rank_zero_info(f"stopped {at}: {stopped_by}")
        else:
            rank_zero_info(f"stopped by {stopped_by} {at}; run the same command to continue")
        if trainer.is_global_zero:
            record_stop(Path(trainer.default_root_dir), trainer.global_step, stopped_by)
    status = stop_signal(trainer)
    if status:
        raise SystemExit(status)


def stop_cause(trainer: Trainer) -> str | None:
    """What stopped training before `trainer.max_steps` (a signal: at any step), in words; None if nothing did or
    it was `fast_dev_run`."""
    status = stop_signal(trainer)
    if status:
        return signal.Signals(status - 128).name
    if trainer.fast_dev_run or trainer.global_step >= (trainer.max_steps or 0):  # type: ignore[attr-defined]
        return None
    stopped_by = callback_stop(trainer)
    if stopped_by:
        return stopped_by
    timers = [callback for callback in trainer.callbacks if isinstance(callback, Timer)]  # type: ignore[attr-defined]
    if any(left is not None and left <= 0 for left in (timer.time_remaining() for timer in timers)):
        return "trainer.max_time"
    return "trainer.should_stop" if trainer.should_stop else "trainer.max_epochs"


def callback_stop(trainer: Trainer) -> str | None:
    """Why a callback that says so (`StopsTraining`, or Lightning's `EarlyStopping`) stopped training, if one did."""
    reasons = [c.stop_reason for c in trainer.callbacks if isinstance(c, StopsTraining)]  # type: ignore[attr-defined]
    early = early_stopped(trainer)  # kept in its state: the same command again trains no further
    if early:
        reasons.append(f"EarlyStopping stopped it ({early}), and it stays stopped; to train on, remove that callback")
    return next(filter(None, reasons), None)


def has_extra(name: str) -> bool:
    """Whether this fork keeps the extra `pretraining.extras.<name>` (it is not imported)."""
    return importlib.util.find_spec(f"pretraining.extras.{name}") is not None


def command(script: str, *args: str | Path) -> str:
    """A command line for console script `script`: the one beside this Python (`.venv/bin/...`), else on PATH."""
    beside = Path(sys.executable).parent / script
    return shlex.join([str(shown(beside)) if beside.exists() else script, *map(str, args)])


def override_value(path: Path) -> str:
    """`path` as the value of a Hydra override: as it is when Hydra reads it so, else quoted."""
    return str(path) if re.fullmatch(r"[A-Za-z0-9_./-]+", str(path)) else hydra_quote(str(path))


def export_name(run: Path) -> str:
    """A name for an export of `run`: its directory's, with its sweep's for a job of a multirun (`0`, `1`)."""
    return f"{run.parent.name}-{run.name}" if run.name.isdigit() else run.name


def shown(path: Path) -> Path:
    """`path` as the user will type it: relative to the current directory when below it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
