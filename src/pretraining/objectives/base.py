"""What every pretraining objective shares: the backbone, AdamW with decay on
matrices only, warmup + cosine schedule, train-loss logging, and validation
metrics computed from sums reduced over all ranks (never averages of averages).

A new objective subclasses `PretrainingObjective` and supplies three things:
`training_loss`, `validation_sums` (what to add up per validation batch) and
`validation_metrics` (what to report from the totals).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import SumMetric

from pretraining.models.transformer import Transformer


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PretrainingObjective(LightningModule):
    """Base LightningModule: subclasses add only their loss and their metrics."""

    def __init__(
        self,
        backbone: Transformer,
        optimizer: Callable[..., Optimizer],
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        validation_sums: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(
                f"model.warmup_steps={warmup_steps} must be >= 0 and model.min_lr_ratio={min_lr_ratio} in [0, 1]"
            )
        self.backbone = backbone
        self.optimizer_factory = optimizer
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.sums = nn.ModuleDict({name: SumMetric().set_dtype(torch.float64) for name in validation_sums})
        self.last_validated_step = -1

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def validation_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        for name, value in self.validation_sums(batch).items():
            cast(SumMetric, self.sums[name]).update(value)

    def on_validation_epoch_end(self) -> None:
        sums = {name: cast(SumMetric, metric) for name, metric in self.sums.items()}
        totals = {name: metric.compute() for name, metric in sums.items()}  # summed over ranks
        for metric in sums.values():
            metric.reset()
        metrics = {f"val/{name}": value.float() for name, value in self.validation_metrics(totals).items()}
        self.log_dict(metrics, prog_bar=True)  # already global: no sync_dist needed
        self.last_validated_step = self.global_step

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        total_steps = self.trainer.max_steps  # checked against warmup_steps by config.check_config
        parameters = [p for p in self.parameters() if p.requires_grad]
        # Weight decay on matrices only: not on biases, norms or scalars.
        groups = [
            {"params": [p for p in parameters if p.dim() >= 2]},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = self.optimizer_factory(groups)
        schedule = partial(
            warmup_cosine, warmup_steps=self.warmup_steps, total_steps=total_steps, min_lr_ratio=self.min_lr_ratio
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }
