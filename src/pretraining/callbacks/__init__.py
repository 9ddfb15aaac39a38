"""Callbacks: checkpoints at step boundaries, lineage, per-batch seeding, preemption, numerical faults,
an audit log of batches, text samples, throughput, the progress bar, a linear probe, the skipped-sample
count and limit."""

from pretraining.callbacks.batch_log import BatchLog
from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.callbacks.lineage import Lineage
from pretraining.callbacks.numerics import NumericalGuard
from pretraining.callbacks.preemption import Preemption
from pretraining.callbacks.probe import LinearProbe
from pretraining.callbacks.progress import ProgressBar
from pretraining.callbacks.register import RegisterCheckpoints
from pretraining.callbacks.skipped_samples import SkippedSamples
from pretraining.callbacks.step_seed import StepSeed
from pretraining.callbacks.text_sample import TextSample
from pretraining.callbacks.throughput import Throughput

__all__ = [
    "BatchLog",
    "Lineage",
    "LinearProbe",
    "NumericalGuard",
    "Preemption",
    "ProgressBar",
    "RegisterCheckpoints",
    "SkippedSamples",
    "StepCheckpoint",
    "StepSeed",
    "TextSample",
    "Throughput",
]
