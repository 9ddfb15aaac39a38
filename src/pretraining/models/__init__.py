"""Backbones in plain PyTorch (no Lightning inside)."""

from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer

__all__ = ["Llama", "Transformer"]
