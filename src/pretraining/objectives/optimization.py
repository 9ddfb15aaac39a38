"""An objective's optimizer and LR schedule (`optimizer_and_schedule`), clipping under bf16 with a fused
optimizer (`clips_unscaled`), refusing a checkpoint of the other optimizer (`check_same_optimizer`), and saying
which settings a resume keeps from its checkpoint (`report_kept_settings`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.optim import Optimizer

from pretraining.errors import ConfigError
from pretraining.models.backbone import backbones
from pretraining.models.parametrization import STANDARD, Parametrization
from pretraining.objectives.optimizers import is_muon, layer_parameters, muon_parameter_groups
from pretraining.objectives.schedules import ScheduleName, lr_schedule

# The param group settings that model.optimizer keys set, in AdamW's groups and in Muon's (`initial_lr`: a
# group's peak LR, the schedule's base); a checkpoint's param groups replace them on resume.
ADAMW_SETTINGS = ("initial_lr", "betas", "eps", "weight_decay")
MUON_SETTINGS = ("initial_lr", "weight_decay", "momentum", "nesterov", "ns_steps", "lr_scaling")


def optimizer_and_schedule(
    factory: Callable[..., Optimizer],
    module: nn.Module,
    trainer: Trainer,
    warmup_steps: int,
    min_lr_ratio: float,
    *,
    schedule: ScheduleName = "cosine",
    decay_steps: int = 120,
) -> OptimizerLRSchedulerConfig:
    """The optimizer `factory` builds over `module`'s trained parameters (`built_optimizer`), and its LR `schedule`
    to `max_steps` (`pretraining.objectives.schedules`)."""
    # Under 16-mixed a fused optimizer unscales after the Trainer's clipping, which Lightning refuses: unfused.
    scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
    optimizer = built_optimizer(factory, module, fusable=not (scaled and trainer.gradient_clip_val))
    scheduler = lr_schedule(optimizer, schedule, warmup_steps, min_lr_ratio, decay_steps, trainer.max_steps)
    optimizer.register_load_state_dict_pre_hook(report_kept_settings)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def built_optimizer(factory: Callable[..., Optimizer], module: nn.Module, fusable: bool = True) -> Optimizer:
    """The optimizer `factory` builds over `module`'s trained parameters, fused where `fusable` and open. Weight
    decay on matrices only; under `MuonAdamW`, Muon takes the matrices in the backbones' layers
    (`optimizers.layer_parameters`); under a parametrization other than standard (the backbones'), each kind of
    parameter has its group, scaled by its rules."""
    trained = [p for p in module.parameters() if p.requires_grad]
    parametrization = rules_of(module)
    layers = layer_parameters(module)
    if parametrization.name != "standard":
        owned = [p for backbone in backbones(module) for p in backbone.parameters()]
        groups = parametrization.parameter_groups(trained, layers, owned, is_muon(factory))
    else:
        matrices, others = [p for p in trained if p.dim() >= 2], [p for p in trained if p.dim() < 2]
        hidden = [p for p in layers if p.dim() == 2]
        plain: list[dict[str, Any]] = [{"params": matrices}, {"params": others, "weight_decay": 0.0}]
        groups = muon_parameter_groups(matrices, others, hidden) if is_muon(factory) else plain
    optimizer = factory(groups, **(fused_if_open(factory, trained) if fusable else {}))
    parametrization.scale(optimizer.param_groups)
    return optimizer


def rules_of(module: nn.Module) -> Parametrization:
    """The parametrization of `module`'s backbones (a contrastive model's two towers share theirs)."""
    rules = {backbone.parametrization for backbone in backbones(module)}
    if len(rules) > 1:
        raise ConfigError(
            f"one model's backbones have other parametrizations ({', '.join(r.describe() for r in rules)})"
        )
    return rules.pop() if rules else STANDARD


def fused_if_open(factory: Callable[..., Optimizer], parameters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """`fused=True` where the config leaves it open (`fused: null`) and every parameter is on CUDA."""
    keywords = factory.keywords if isinstance(factory, partial) else {}
    if "fused" in keywords and keywords["fused"] is None and all(p.device.type == "cuda" for p in parameters):
        return {"fused": True}
    return {}


def clips_unscaled(plugin: Precision, optimizer: Optimizer, value: float | None, algorithm: str | None) -> bool:
    """Clip as full precision does when gradients carry no loss scale (bf16-mixed); say whether it did.
    Lightning's `MixedPrecision.clip_gradients` refuses optimizers able to unscale (fused AdamW) even with no
    scale, which would stop every bf16 run with one; the plugin's `clip_grad_by_*` lack that refusal."""
    if not (isinstance(plugin, MixedPrecision) and plugin.scaler is None and value):
        return False
    if GradClipAlgorithmType((algorithm or "norm").lower()) == GradClipAlgorithmType.VALUE:
        plugin.clip_grad_by_value(optimizer, float(value))
    else:
        plugin.clip_grad_by_norm(optimizer, float(value))
    return True


def check_same_optimizer(checkpoint: dict[str, Any], muon: bool) -> None:
    """Refuse to continue a checkpoint's optimizer state with the other optimizer (the groups differ)."""
    states = checkpoint.get("optimizer_states") or [{}]
    groups = states[0].get("param_groups")
    if groups is None or any(group.get("muon") for group in groups) == muon:
        return
    saved, wanted = ("muon", "adamw") if not muon else ("adamw", "muon")
    raise ConfigError(
        f"the checkpoint was trained with model/optimizer={saved}, and this run builds {wanted}: continue it with "
        f"model/optimizer={saved}, or start a separate run (run_name=<new name> or resume=never)"
    )


def report_kept_settings(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Before a checkpoint's optimizer state replaces this run's (its param groups win: a resumed run keeps
    the LRs and settings it trained with), say which of this run's settings it leaves without effect."""
    for key, (asked, kept) in kept_settings(optimizer.param_groups, state_dict.get("param_groups", [])).items():
        rank_zero_info(
            f"model.optimizer.{key}: this run asks {asked}, but the resumed run keeps the {kept} it trained with "
            "(a run continues its optimizer's settings; a separate run, run_name=<new name>, trains with new ones)"
        )


def kept_settings(ours: Sequence[dict[str, Any]], saved: Sequence[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """{model.optimizer key: (this run's value, the checkpoint's)} for each setting in which the groups differ."""
    kept: dict[str, tuple[Any, Any]] = {}
    for group, saved_group in zip(ours, saved, strict=False):  # other group counts: torch refuses them next
        for setting in MUON_SETTINGS if group.get("muon") else ADAMW_SETTINGS:
            if setting in group and setting in saved_group and differ(group[setting], saved_group[setting]):
                kept.setdefault(config_key(group, setting), (group[setting], saved_group[setting]))
    return kept


def config_key(group: dict[str, Any], setting: str) -> str:
    """The model.optimizer key that sets `setting` of `group`: a Muon group's are muon_*."""
    name = "lr" if setting == "initial_lr" else setting
    return f"muon_{name}" if group.get("muon") else name


def differ(ours: Any, saved: Any) -> bool:
    """Whether two settings differ; betas are a tuple read back from a checkpoint, a list from a config."""
    if isinstance(ours, list | tuple) and isinstance(saved, list | tuple):
        return tuple(ours) != tuple(saved)
    return bool(ours != saved)
