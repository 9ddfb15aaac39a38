"""The LightningDataModule over one shard directory (`dir`) or a weighted mixture of several (`sources`:
`pretraining.data.mixture`), its examples made by the format `data.format` names (`pretraining.data.formats`).

The batch is configured globally (`global_batch_size` examples, or `global_batch_tokens`, per step, in
micro-batches of `micro_batch_size`); the accumulation and each device's examples follow from the number of
devices (`pretraining.data.batches.BatchPlan`), so the same config trains on the same examples on any number.

It owns the training data position (`position`, which callbacks read) and the randomness keyed on it
(`pretraining.data.position`). A mixture validates on each source apart (`val/<source>/<metric>` beside
`val/<metric>`). Bad data follows `bad_data` (`pretraining.data.reader`); a shard missing or altered at
start-up keeps its place in the order and is skipped whole, and `pretraining.data.sources.check_skips` stops
the run once too much was skipped (`pretraining.callbacks.data_counts.DataCounts` calls it for all ranks).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Annotated, Any, Literal

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from pretraining.data.batches import BatchPlan, BatchStream, batch_plan, default_streams, global_batch_examples
from pretraining.data.formats import ExampleFormat, Tensors
from pretraining.data.loader import training_loader, validation_loader
from pretraining.data.mixture import Mixture, Source, source_settings
from pretraining.data.position import DataPosition, seed_step
from pretraining.data.sources import check_skips, checked_shards, load_source, refused_samples
from pretraining.data.stream import ShardStream, stable_hash
from pretraining.data.tokenizer import Tokenizer
from pretraining.data.validation import rank_share, validation_examples
from pretraining.ranges import Positive, Range, checked_ranges


class ShardDataModule(LightningDataModule):
    """Examples streamed from WebDataset shards, made by the example format `format` builds with the tokenizer.
    Training is an infinite `BatchStream` per rank (train with `max_steps`); validation a fixed sample of
    `val_size` spread over the validation split (`pretraining.data.validation`). `streams` None: `default_streams`.
    """

    @checked_ranges("data")
    def __init__(
        self,
        dir: str | None,
        tokenizer: Tokenizer,
        format: Callable[[Tokenizer], ExampleFormat[Any]],
        global_batch_size: Positive | None = None,
        global_batch_tokens: Positive | None = None,
        micro_batch_size: Positive | None = None,
        streams: Positive | None = None,
        seed: int = 0,
        num_workers: Annotated[int, Range(ge=0)] = 1,
        shuffle_buffer: Positive = 4096,
        val_size: Positive = 64,
        val_batch_size: Positive | None = None,
        verify_checksums: bool = True,
        pin_memory: bool | None = None,
        bad_data: Literal["skip", "raise"] = "skip",
        max_skip_fraction: Annotated[float, Range(ge=0, le=1)] = 0.01,
        trust_pipe_commands: bool = False,
        sources: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.tokenizer, self.format = tokenizer, format(tokenizer)
        global_batch_size = global_batch_examples(global_batch_size, global_batch_tokens, self.format.example_tokens)
        streams = streams or default_streams(global_batch_size)
        batch_plan(global_batch_size, micro_batch_size, streams, 1)  # a config error shows before any work
        settings = source_settings(sources, dir)  # a config error shows before any data is read
        self.bad_data, self.max_skip_fraction = bad_data, max_skip_fraction
        # Every source's manifest and fields before any checksum (minutes): a mistake in the last shows at once.
        loaded = [load_source(source, tokenizer, format, self.format, trust_pipe_commands) for source in settings]
        self.sources = [checked_shards(source, verify_checksums, bad_data) for source in loaded]
        self.mixture = Mixture(settings, seed)
        self.global_batch_size, self.micro_batch_size, self.streams = global_batch_size, micro_batch_size, streams
        self.seed, self.num_workers = seed, num_workers
        self.shuffle_buffer, self.pin_memory = shuffle_buffer, pin_memory
        self.val_size, self.val_batch_size = val_size, val_batch_size
        # Workers already tokenize in parallel; Rust threads in forked workers can hang.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.position = DataPosition(self.sources, streams * self.workers)
        check_skips(refused_samples(self.sources), 0, self.sources, max_skip_fraction)

    @property
    def data_version(self) -> str:
        """The version of the data the run reads (`DataPosition.data_version`, which it saves)."""
        return self.position.data_version

    @property
    def mixture_settings(self) -> dict[str, dict[str, Any]] | None:
        """Each source's weight, cap, policy and fields (None for one source): a resume with others is a change
        of mixture (`resume_allow=[mixture]`)."""
        if len(self.sources) == 1:
            return None
        return {
            source.name: {key: getattr(source.settings, key) for key in ("weight", "max_epochs", "exhausted")}
            | {"fields": source.format.field_keys}
            for source in self.sources
        }

    @property
    def lineage(self) -> dict[str, Any]:
        """What a checkpoint's lineage records of the data besides its version."""
        sources = {
            source.name: {"dir": source.settings.dir, "version": source.manifest.version} for source in self.sources
        }
        mixture = self.mixture_settings
        # A run that was a mixture keeps its phases after a resume on one source: a lineage is append-only.
        was_mixture = mixture or len(self.position.phases) > 1
        phases = {"mixture_phases": self.position.phases} if was_mixture else {}
        return {"topology": self.topology, "sources": sources, "mixture": mixture, **phases}

    def plan_for(self, world_size: int) -> BatchPlan:
        """How the global batch is split over `world_size` devices (a ConfigError if it cannot be)."""
        return batch_plan(self.global_batch_size, self.micro_batch_size, self.streams, world_size)

    @property
    def plan(self) -> BatchPlan:
        return self.plan_for(self.rank_and_world[1])

    @property
    def workers(self) -> int:
        """DataLoader workers per rank (`num_workers=0` reads in the main process, like one worker)."""
        return max(1, self.num_workers)

    def topology_for(self, world_size: int) -> dict[str, int | str]:
        """What decides which examples each step trains on, besides the cursors: not the number of devices,
        only the accumulation Lightning's loop counts batches with."""
        return {
            "global_batch_size": self.global_batch_size,
            "streams": self.streams,
            "workers": self.workers,
            "accumulation": self.plan_for(world_size).accumulation,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            **self.format.lengths,
            **self.format.field_keys,
        }

    @property
    def topology(self) -> dict[str, int | str]:
        return self.topology_for(self.rank_and_world[1])

    @property
    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    @property
    def batch_slot(self) -> tuple[int, int]:
        """(step, slot in the global batch) of the micro-batch consumed last, the same on any number of devices
        (its randomness is keyed on it: `seed_step`)."""
        return self.plan.slot_of(self.rank_and_world[0], self.position.batches_consumed - 1)

    def train_dataloader(self) -> DataLoader:
        """The training micro-batches of this rank, continuing from the data position."""
        rank, _ = self.rank_and_world
        streams = [self.shard_stream(source) for source in self.sources]
        position = self.position
        stream = BatchStream(streams, self.plan, rank, position.cursors, position.batches_consumed, self.mixture)
        return training_loader(stream, self.num_workers, self.pin_memory)

    def shard_stream(self, source: Source) -> ShardStream:
        """The shard streams of a source's training split."""
        shards = source.manifest.shards("train")
        refused = {
            index: source.refused[shard.name] for index, shard in enumerate(shards) if shard.name in source.refused
        }
        sub_streams = self.streams * self.workers
        if len(shards) < sub_streams:
            warnings.warn(
                f"{len(shards)} training shards of {source.settings.dir} for {sub_streams} sub-streams (data.streams x "
                f"data.num_workers): several sub-streams read the same shard at once, so a step can repeat examples; "
                f"build more, smaller shards (`pretrain-data build --shard-bytes`) or lower data.streams",
                stacklevel=3,
            )
        return ShardStream(
            source.manifest.urls("train"),
            source.format,
            self.seed,
            self.shuffle_buffer,
            [shard.samples for shard in shards],
            refused,
            self.bad_data,
            source.settings.max_epochs,
            source.name if len(self.sources) > 1 else "",
        )

    def on_before_batch_transfer(self, batch: Tensors, dataloader_idx: int) -> Tensors:
        if "positions" in batch:  # a training batch (validation has none): it advances the position
            self.position.advance(batch)
            seed_step(stable_hash("batch", self.seed, *self.batch_slot))
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The data position of every rank (a collective under DDP/FSDP: every rank calls it on save)."""
        return self.position.state_dict(self.topology, self.plan.accumulation)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (`DataPosition.load_state_dict`)."""
        self.position.load_state_dict(state, self.topology, self.plan, self.rank_and_world[0])

    @cached_property
    def validation_sets(self) -> list[list[Tensors]]:
        """All ranks' validation examples of each source, read once however often validation runs."""
        mixture = len(self.sources) > 1
        return [source_validation_examples(source, self.val_size, self.bad_data, mixture) for source in self.sources]

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """This rank's validation loader, or for a mixture one per source in `sources` order."""
        rank, world_size = self.rank_and_world
        loaders = [
            validation_loader(
                rank_share(examples, rank, world_size, self.format.kind),
                self.val_batch_size or self.plan.micro_batch,
                self.pin_memory,
            )
            for examples in self.validation_sets
        ]
        return loaders[0] if len(loaders) == 1 else loaders


def source_validation_examples(source: Source, size: int, policy: str, mixture: bool) -> list[Tensors]:
    """All ranks' validation examples of a source (but its refused shards), announced on rank zero."""
    shards = [shard for shard in source.manifest.shards("validation") if shard.name not in source.refused]
    urls, documents = [source.manifest.url(shard) for shard in shards], sum(shard.samples for shard in shards)
    chosen = validation_examples(urls, source.format, size, documents, policy)
    of = f" of {source.settings.key}" if mixture else ""
    rank_zero_info(
        f"validation{of}: {len(chosen.examples)} {source.format.kind} from {chosen.text_bytes:,} bytes of text of "
        f"{chosen.documents} of the {chosen.split_documents} documents of the validation split, "
        f"in {len(shards)} shards"
    )
    return chosen.examples
