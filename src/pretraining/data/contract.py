"""What callbacks may rely on in a run's DataModule, as a named Protocol (`ShardDataModule` fits it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lightning.pytorch import Trainer

from pretraining.data.formats import ExampleFormat
from pretraining.data.mixture import Source
from pretraining.data.position import DataPosition
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError


@runtime_checkable
class TrainingData(Protocol):
    """The data side of a run, as the callbacks see it."""

    tokenizer: Tokenizer
    sources: list[Source]  # the shard sets it reads (one, or a mixture's), in `data.sources` order
    format: ExampleFormat[Any]
    position: DataPosition  # this rank's: batches consumed, samples read and skipped, draws, sources run out
    max_skip_fraction: float  # the share of skipped samples that stops the run (`pretraining.data.sources`)

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
