"""One LightningModule per pretraining objective, over a shared base."""

from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM

__all__ = ["CausalLM", "PretrainingObjective"]
