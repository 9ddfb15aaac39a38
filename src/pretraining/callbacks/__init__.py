"""Callbacks: checkpoint lineage and text samples."""

from pretraining.callbacks.lineage import Lineage
from pretraining.callbacks.text_sample import TextSample

__all__ = ["Lineage", "TextSample"]
