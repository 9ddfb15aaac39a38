"""The optimizer an objective trains with: built with its LR schedule (`optimizer_and_schedule`: AdamW with
weight decay on matrices only, or Muon for the hidden matrices; a warmup then a cosine decay, or
warmup-stable-decay), fused where it may be, its gradients clipped also under bf16 with a fused optimizer
(`clips_unscaled`), and a checkpoint of the other optimizer refused (`check_same_optimizer`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch.optim import Optimizer

from pretraining.errors import ConfigError
from pretraining.objectives.optimizers import is_muon, muon_parameter_groups
from pretraining.objectives.schedules import ScheduleName, lr_schedule


def optimizer_and_schedule(
    factory: Callable[..., Optimizer],
    parameters: Sequence[torch.Tensor],
    trainer: Trainer,
    warmup_steps: int,
    min_lr_ratio: float,
    *,
    schedule: ScheduleName = "cosine",
    decay_steps: int = 120,
    hidden: Sequence[torch.Tensor] = (),
) -> OptimizerLRSchedulerConfig:
    """The optimizer `factory` builds over `parameters` and its LR `schedule` to `trainer.max_steps`
    (`pretraining.objectives.schedules`), stepped every optimizer step. Weight decay applies to matrices only:
    not to biases, norms or scalars (such as a temperature). Under `MuonAdamW`, Muon takes the matrices among
    `hidden` (`optimizers.hidden_matrices`) in a group of its own; AdamW's two groups are as they were."""
    trained = [p for p in parameters if p.requires_grad]
    matrices, others = [p for p in trained if p.dim() >= 2], [p for p in trained if p.dim() < 2]
    if is_muon(factory):
        groups = muon_parameter_groups(matrices, others, hidden)
    else:
        groups = [{"params": matrices}, {"params": others, "weight_decay": 0.0}]
    # Under a loss scaler (16-mixed) a fused optimizer unscales inside its step, after the clipping that the
    # Trainer does first: Lightning refuses that, so such a run gets the unfused kernels.
    scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
    fused = {} if scaled and trainer.gradient_clip_val else fused_if_open(factory, trained)
    optimizer = factory(groups, **fused)
    scheduler = lr_schedule(optimizer, schedule, warmup_steps, min_lr_ratio, decay_steps, trainer.max_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fused_if_open(factory: Callable[..., Optimizer], parameters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """`fused=True` when the optimizer config leaves it open (`fused: null`) and every parameter is on
    CUDA: one kernel for the whole update instead of several per tensor."""
    keywords = factory.keywords if isinstance(factory, partial) else {}
    if "fused" in keywords and keywords["fused"] is None and all(p.device.type == "cuda" for p in parameters):
        return {"fused": True}
    return {}


def clips_unscaled(plugin: Precision, optimizer: Optimizer, value: float | None, algorithm: str | None) -> bool:
    """Clip as full precision does when the gradients carry no loss scale (bf16-mixed), and say whether it
    did: Lightning's `MixedPrecision.clip_gradients` refuses every optimizer able to unscale (such as fused
    AdamW) even when there is no scale to remove, which would stop every bf16 run with a fused optimizer.
    The plugin's own `clip_grad_by_norm` / `clip_grad_by_value` clip its main parameters, as
    `Precision.clip_gradients` does, without that refusal."""
    if not (isinstance(plugin, MixedPrecision) and plugin.scaler is None and value):
        return False
    if GradClipAlgorithmType((algorithm or "norm").lower()) == GradClipAlgorithmType.VALUE:
        plugin.clip_grad_by_value(optimizer, float(value))
    else:
        plugin.clip_grad_by_norm(optimizer, float(value))
    return True


def check_same_optimizer(checkpoint: dict[str, Any], muon: bool) -> None:
    """Refuse to continue a checkpoint's optimizer state with the other optimizer (its param groups differ),
    naming the one it was trained with; a checkpoint without an optimizer state (weights) passes."""
    states = checkpoint.get("optimizer_states") or [{}]
    groups = states[0].get("param_groups")
    if groups is None or any(group.get("muon") for group in groups) == muon:
        return
    saved, wanted = ("muon", "adamw") if not muon else ("adamw", "muon")
    raise ConfigError(
        f"the checkpoint was trained with model/optimizer={saved}, and this run builds {wanted}: continue it with "
        f"model/optimizer={saved}, or start a separate run (run_name=<new name> or resume=never)"
    )
