"""One LightningModule per pretraining objective, over a shared base."""

from pretraining.objectives.base import PretrainingObjective, build_objective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.distill import Distill, Distillation, DistillMasked, FrozenTeacher
from pretraining.objectives.masked_lm import MaskedLM

__all__ = [
    "CausalLM",
    "Contrastive",
    "Distill",
    "DistillMasked",
    "Distillation",
    "FrozenTeacher",
    "MaskedLM",
    "PretrainingObjective",
    "build_objective",
]
