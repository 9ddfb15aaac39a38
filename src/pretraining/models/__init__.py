"""Backbones in plain PyTorch (no Lightning inside)."""

from pretraining.models.transformer import Transformer

__all__ = ["Transformer"]
