"""How every objective optimises: AdamW (or the configured optimizer) with weight decay on matrices only,
a linear warmup then cosine decay, and gradient clipping that also works under bf16 with a fused optimizer."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_and_schedule(
    factory: Callable[..., Optimizer],
    parameters: Sequence[torch.Tensor],
    trainer: Trainer,
    warmup_steps: int,
    min_lr_ratio: float,
) -> OptimizerLRSchedulerConfig:
    """The optimizer `factory` builds over `parameters` and its warmup + cosine schedule to `trainer.max_steps`,
    stepped every optimizer step. Weight decay applies to matrices only: not to biases, norms or scalars
    (such as a temperature)."""
    trained = [p for p in parameters if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2]},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]
    # Under a loss scaler (16-mixed) a fused optimizer unscales inside its step, after the clipping that the
    # Trainer does first: Lightning refuses that, so such a run gets the unfused kernels.
    scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
    fused = {} if scaled and trainer.gradient_clip_val else fused_if_open(factory, trained)
    optimizer = factory(groups, **fused)
    schedule = partial(
        warmup_cosine, warmup_steps=warmup_steps, total_steps=trainer.max_steps, min_lr_ratio=min_lr_ratio
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"}}


def fused_if_open(factory: Callable[..., Optimizer], parameters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """`fused=True` when the optimizer config leaves it open (`fused: null`) and every parameter is on
    CUDA: one kernel for the whole update instead of several per tensor."""
    keywords = factory.keywords if isinstance(factory, partial) else {}
    if "fused" in keywords and keywords["fused"] is None and all(p.device.type == "cuda" for p in parameters):
        return {"fused": True}
    return {}


def clips_unscaled(plugin: Precision, optimizer: Optimizer, value: float | None, algorithm: str | None) -> bool:
    """Clip as full precision does when the gradients carry no loss scale (bf16-mixed), and say whether it
    did: Lightning's `MixedPrecision` refuses every optimizer able to unscale (such as fused AdamW) even when
    there is no scale to remove, which would stop every bf16 run with a fused optimizer."""
    if not (isinstance(plugin, MixedPrecision) and plugin.scaler is None and value):
        return False
    Precision.clip_gradients(plugin, optimizer, float(value), GradClipAlgorithmType((algorithm or "norm").lower()))
    return True
