"""What callbacks may rely on in a run's DataModule, as a named Protocol (`ShardDataModule` fits it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning.pytorch import Trainer

from pretraining.data.formats import ExampleFormat
from pretraining.data.mixture import Source
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError


@runtime_checkable
class TrainingData(Protocol):
    """The data side of a run, as the callbacks see it."""

    tokenizer: Tokenizer
    sources: list[Source]  # the shard sets it reads (one, or a mixture's), in `data.sources` order
    format: ExampleFormat[Any]
    batches_consumed: int  # training micro-batches this rank has consumed
    samples_read: int  # training samples this rank's consumed batches read ...
    samples_skipped: int  # ... and skipped as unusable
    drawn: list[int]  # examples each source gave this rank's consumed batches
    ran_out: set[int]  # the sources that ran out (their max_epochs) in a sub-stream this rank reads

    @property
    def lineage(self) -> dict[str, Any]:
        """What a checkpoint's lineage records of the data besides its version."""
        ...

    @property
    def batch_slot(self) -> tuple[int, int]:
        """(step, slot in the step's global batch) of the micro-batch consumed last."""
        ...

    @property
    def topology(self) -> dict[str, int]:
        """What decides which examples each step trains on, besides the data position."""
        ...

    def check_skips(self, skipped: int, read: int) -> None:
        """Stop the run if too many of the training samples read were skipped."""
        ...

    def stop_reason(self, ran_out: list[bool]) -> str | None:
        """Why the run stops here, given which sources ran out on any rank (None: it goes on)."""
        ...


def training_data(trainer: Trainer, key: str) -> TrainingData:
    """The trainer's DataModule, refused (naming the callback's config `key`) unless it is `TrainingData`."""
    datamodule = getattr(trainer, "datamodule", None)
    if not isinstance(datamodule, TrainingData):
        removable = f", or remove {key} (~{key})" if key.startswith("callbacks.") else ""
        raise ConfigError(
            f"{key} needs a DataModule with the data position and shards of "
            "pretraining.data.datamodule.ShardDataModule "
            f"(pretraining.data.contract.TrainingData), and {type(datamodule).__name__} is not one: train with "
            f"a data config of configs/data/{removable}"
        )
    return datamodule
