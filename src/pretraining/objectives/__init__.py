"""One LightningModule per pretraining objective, over a shared base."""

from pretraining.objectives.base import PretrainingObjective, build_objective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM

__all__ = ["CausalLM", "Contrastive", "MaskedLM", "PretrainingObjective", "build_objective"]
