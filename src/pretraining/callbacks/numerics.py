"""Numerical faults: skip an optimizer step whose loss or gradient norm is not finite, stop after
too many in a row, log loss spikes, and fail a run whose result is not a number (`check_result`)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.checkpoint import saved_checkpoints
from pretraining.errors import PretrainingError
from pretraining.files import open_to_append
from pretraining.objectives.base import NONFINITE_BATCHES, PretrainingObjective
from pretraining.ranges import Range, checked_ranges


class NumericalError(RuntimeError, PretrainingError):
    """Training stopped on consecutive non-finite steps, or a run or evaluation ended with no finite result; the
    message names them, what was kept, the fix."""


@dataclass
class LossStatistics:
    """Exponentially weighted mean and variance of the step loss over about `window` steps; the first steps
    weigh 1/n each, so the estimate is unbiased from the start."""

    window: int
    mean: float = 0.0
    variance: float = 0.0
    count: int = 0

    def update(self, loss: float) -> None:
        self.count += 1
        weight = max(1 / self.count, 2 / (self.window + 1))
        difference = loss - self.mean
        self.mean += weight * difference
        self.variance = (1 - weight) * (self.variance + weight * difference**2)

    def is_spike(self, loss: float, threshold: float) -> bool:
        """Whether `loss` is over `threshold` standard deviations above the mean, once a window was seen."""
        return self.count >= self.window and loss > self.mean + threshold * math.sqrt(self.variance)


class NumericalGuard(Callback):
    """Check every optimizer step after gradient accumulation, before clipping and the update:

    - A non-finite loss (any rank, any micro-batch) or gradient norm skips the step: its gradients are dropped,
      so weights and optimizer state are unchanged; the LR schedule and `max_steps` still advance. Counted
      (`train/skipped_steps`) and warned about; after `max_consecutive_bad_steps` in a row (null: never), a
      `NumericalError`. No bad update is ever applied, so every checkpoint holds finite weights.
    - Under float16, a finite loss with overflowing gradients is the GradScaler's to skip: not counted, and it
      does not break a run of bad steps.
    - A loss over `spike_threshold` (null: off) standard deviations above the moving mean (`spike_window`) is a
      spike: counted (`train/loss_spikes`), warned about, and appended by rank zero as a JSON line to
      `spike_log` (default `<run dir>/loss_spikes.jsonl`; a replayed step's later line wins). Spikes are trained
      on and enter the statistics, so a lasting change of level stops being flagged after about a window.

    `train/grad_norm` (before clipping) and the counts go through the objective's `step_values`. Every rank
    decides alike: loss and norm are averaged by one all-reduce, so a NaN on one rank is seen by all. That costs
    a device sync per step, which a loop skipping non-finite steps needs (`~callbacks.numerics` removes it).
    Counters and statistics travel in checkpoints, so a resumed run counts as the uninterrupted one would."""

    @checked_ranges("callbacks.numerics")
    def __init__(
        self,
        max_consecutive_bad_steps: Annotated[int, Range(ge=1)] | None = 10,
        spike_threshold: Annotated[float, Range(gt=0)] | None = 6.0,
        spike_window: Annotated[int, Range(ge=1)] = 100,
        spike_log: str | None = None,
    ) -> None:
        self.max_bad, self.threshold = max_consecutive_bad_steps, spike_threshold
        self.spike_log = Path(spike_log) if spike_log else None
        self.statistics = LossStatistics(spike_window)
        self.skipped_steps = self.loss_spikes = 0
        self.bad_in_a_row, self.first_bad_step = 0, 0
        self.step_loss: torch.Tensor | None = None  # the sum of this step's micro-batch losses, on the device

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.spike_log = self.spike_log or Path(trainer.default_root_dir) / "loss_spikes.jsonl"
        self.step_loss = None

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        # Lightning passes each micro-batch's loss divided by the accumulation: their sum is the step's mean.
        loss = loss.detach().float()
        self.step_loss = loss if self.step_loss is None else self.step_loss + loss

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        loss, norm = self.loss_and_norm(trainer, pl_module, optimizer)
        step = trainer.global_step + 1
        if math.isfinite(loss) and math.isfinite(norm):
            self.bad_in_a_row = 0
            self.watch_for_spike(trainer, step, loss, norm, learning_rates(optimizer))
        elif math.isfinite(loss) and grad_scaler(trainer) is not None:
            pass  # a float16 overflow: the GradScaler skips this step and lowers its scale
        else:
            self.skip(trainer, optimizer, step, loss, norm)
        if isinstance(pl_module, PretrainingObjective):  # logged where Lightning writes the step's values
            counts = {"train/skipped_steps": float(self.skipped_steps), "train/loss_spikes": float(self.loss_spikes)}
            pl_module.step_values.update({"train/grad_norm": norm, **counts})

    def loss_and_norm(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> tuple[float, float]:
        """The step's unscaled loss and global gradient norm, averaged over ranks: identical on every rank."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):  # FSDP2: each rank holds a shard's norm
            norm = norm.full_tensor()
        assert self.step_loss is not None, "on_before_backward was not called in this step"
        values = torch.stack([self.step_loss, norm.float().to(self.step_loss.device)])
        self.step_loss = None
        loss, norm_value = trainer.strategy.reduce(values, reduce_op="mean").tolist()  # the one host sync
        scaler = grad_scaler(trainer)
        if scaler is not None:  # the backward pass saw the loss multiplied by the scale
            loss /= scaler.get_scale()
        return loss, norm_value

    def skip(self, trainer: Trainer, optimizer: Optimizer, step: int, loss: float, norm: float) -> None:
        optimizer.zero_grad(set_to_none=True)  # the optimizer passes over parameters without gradients
        self.skipped_steps += 1
        self.bad_in_a_row += 1
        if self.bad_in_a_row == 1:
            self.first_bad_step = step
        rank_zero_warn(
            f"step {step}: loss {loss}, gradient norm {norm}: skipped (weights and optimizer state unchanged, "
            f"the LR schedule advances); {self.skipped_steps} skipped so far, {self.bad_in_a_row} in a row"
        )
        if self.max_bad is not None and self.bad_in_a_row >= self.max_bad:
            raise NumericalError(self.stop_message(trainer, step, loss, norm))

    def stop_message(self, trainer: Trainer, step: int, loss: float, norm: float) -> str:
        newest = newest_checkpoint(trainer)
        if newest:
            saved = f"the newest checkpoint, {newest[1]} (step {newest[0]}), is intact"
            again = (
                f"Running the same command again continues from it and meets the same batches; to skip past them, "
                f"add ckpt_path={newest[1]} callbacks.numerics.max_consecutive_bad_steps=null"
            )
        else:
            saved = "no checkpoint has been saved yet"
            again = "To skip past them, add callbacks.numerics.max_consecutive_bad_steps=null"
        return (
            f"{self.bad_in_a_row} consecutive steps ({self.first_bad_step} to {step}) had a non-finite loss or "
            f"gradient norm (the last: loss {loss}, gradient norm {norm}): stopping, as "
            f"callbacks.numerics.max_consecutive_bad_steps={self.max_bad} says. None of them changed the weights; "
            f"{saved}. Likely causes: a learning rate too high for this model and batch (lower model.optimizer.lr "
            f"- and model.optimizer.muon_lr with Muon - or lengthen model.warmup_steps, in a new run: a run continued "
            f"from a checkpoint keeps the LR in its optimizer state), float16 overflow (trainer.precision=bf16-mixed), "
            f"or bad data at these steps (log the batches with callbacks=[default,batch_log]). {again}."
        )

    def watch_for_spike(
        self, trainer: Trainer, step: int, loss: float, norm: float, learning_rates: dict[str, float]
    ) -> None:
        statistics = self.statistics
        if self.threshold is not None and statistics.is_spike(loss, self.threshold):
            self.loss_spikes += 1
            std = math.sqrt(statistics.variance)
            record = {"step": step, "loss": loss, "mean": statistics.mean, "std": std, "grad_norm": norm}
            record |= learning_rates
            rank_zero_warn(
                f"step {step}: loss spike {loss:.4g} ({(loss - statistics.mean) / std:.1f} standard deviations above "
                f"the recent mean {statistics.mean:.4g}); logged to {self.spike_log}"
            )
            if trainer.is_global_zero:
                append_line(self.spike_log, {**record, "time": time.time()})  # type: ignore[arg-type]  # set at start
        statistics.update(loss)

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "loss_spikes": self.loss_spikes,
            "bad_in_a_row": self.bad_in_a_row,
            "first_bad_step": self.first_bad_step,
            "loss_statistics": {key: value for key, value in asdict(self.statistics).items() if key != "window"},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps, self.loss_spikes = state_dict["skipped_steps"], state_dict["loss_spikes"]
        self.bad_in_a_row, self.first_bad_step = state_dict["bad_in_a_row"], state_dict["first_bad_step"]
        # The window is the config's: a run continued with another one keeps the statistics so far.
        self.statistics = LossStatistics(self.statistics.window, **state_dict["loss_statistics"])


def check_result(metrics: Mapping[str, float], steps: int) -> None:
    """Fail a run whose result no reader or sweep may take for a number: its last validation gave a non-finite
    value, or every one of its `steps` steps was skipped as non-finite (`train/skipped_steps`: untrained weights)."""
    reasons = []
    if steps and metrics.get("train/skipped_steps", 0) >= steps:
        reasons.append(f"every one of its {steps} steps had a non-finite loss or gradient norm and was skipped")
    nonfinite = nonfinite_validation(metrics)
    if nonfinite:
        reasons.append(f"its last validation gave non-finite values {nonfinite}")
    if reasons:
        raise NumericalError(
            f"the run failed: {'; '.join(reasons)}: it has no result (a sweep is given none). Likely causes: "
            f"a setting that makes every loss NaN (a model.backbone value), a learning rate too high "
            f"(model.optimizer.lr), float16 overflow (trainer.precision=bf16-mixed), or a checkpoint with non-finite "
            f"weights; change it and start over with resume=never"
        )


def nonfinite_validation(metrics: Mapping[str, float]) -> str | None:
    """Where a validation's metrics show non-finite values (`in N of its batches: val/loss, ...`), or None."""
    names = [name for name, value in sorted(metrics.items()) if name.startswith("val/") and not math.isfinite(value)]
    batches = int(metrics.get(f"val/{NONFINITE_BATCHES}", 0))
    if not names and not batches:
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"in {batches} of its batches" + (f": {shown}" if shown else "")


def learning_rates(optimizer: Optimizer) -> dict[str, float]:
    """A spike record's learning rates: `lr` (the first group's) and, under MuonAdamW, `muon_lr`."""
    rates = {"lr": optimizer.param_groups[0]["lr"]}
    for group in optimizer.param_groups:
        if group.get("muon"):
            rates["muon_lr"] = group["lr"]
    return rates


def grad_scaler(trainer: Trainer) -> Any:
    """The precision plugin's GradScaler (float16 mixed precision), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)


def newest_checkpoint(trainer: Trainer) -> tuple[int, Path] | None:
    """The step and path of the newest checkpoint `StepCheckpoint` saved, once any write in flight completes."""
    savers = [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, StepCheckpoint)]
    for saver in savers:
        saver.finish_writing_on_a_stop(trainer)
    saved = [found for saver in savers for found in saved_checkpoints(saver.dirpath)]
    return max(saved) if saved else None


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line in a single write: a crash cannot leave half a line before a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_to_append(path, "the loss-spike record", "remove it; the run keeps its own") as file:
        file.write(json.dumps(record) + "\n")
