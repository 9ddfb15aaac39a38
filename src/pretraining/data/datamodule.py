"""The LightningDataModule over a shard directory with a manifest, whatever its examples: the example
format that `data.format` names (`pretraining.data.formats`) makes them.

The batch is configured globally: `global_batch_size` examples (or
`global_batch_tokens`) per optimizer step over all devices, run in
micro-batches of `micro_batch_size` per device; the gradient accumulation
follows from the number of devices (`plan`), and so do the examples each
device reads (`pretraining.data.batches.BatchPlan`): the same config trains on
the same examples, step by step, on any number of devices.

The DataModule also owns the training data position, which it advances with every batch the training
loop consumes and saves in every checkpoint, and the randomness of training keyed on it
(`pretraining.data.position`).

It reads one shard directory (`dir`) or a weighted mixture of several (`sources`, by name: each its
own manifest, weight, optional cap on repetitions; `pretraining.data.mixture`). A mixture's data
position is a cursor per (source, sub-stream); it validates on each source apart (one validation
loader per source, `val/<source>/<metric>` beside the weighted mixture's `val/<metric>`), and counts the
examples each source gave (`drawn`: logged as tokens and shares by `DataCounts`).

Bad data follows `bad_data`: `skip` (the default) skips unusable samples and
shards with a warning and counts them (`samples_read`, `samples_skipped`, kept in
the checkpoint with the position); `raise` stops on the first. A shard missing
or altered at start-up keeps its place in the stream order and is skipped
whole. `check_skips` stops the run once too much was skipped
(`pretraining.callbacks.data_counts.DataCounts` calls it with the totals of all ranks).
"""

from __future__ import annotations

import dataclasses
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
from pretraining.data.manifest import MANIFEST, Manifest
from pretraining.data.mixture import Mixture, Source, SourceSettings, source_settings
from pretraining.data.position import DataPosition, seed_step
from pretraining.data.stream import ShardStream, stable_hash
from pretraining.data.tokenizer import Tokenizer
from pretraining.data.validation import validation_examples
from pretraining.errors import ConfigError, ShardError
from pretraining.ranges import Positive, Range, checked_ranges


class ShardDataModule(LightningDataModule):
    """Examples streamed from WebDataset shards, made by the example format that `format` builds
    with the tokenizer (`pretraining.data.formats`: `data.format` in the config).

    Training is an infinite `BatchStream` per rank (train with `max_steps`).
    Validation is a fixed sample spread over the whole validation split (`validation_examples`: up to
    `val_size` documents, evenly spaced; for packed text, `val_size` blocks' worth of UTF-8 bytes shared
    out over them; a multiple of 8 examples kept), dealt to ranks in equal numbers, the same every time.
    `streams` None: `default_streams`.
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
        # Every source's manifest and fields, checked before any shard is read for its checksum (which can take
        # minutes): a mistake in the last source shows at once.
        loaded = [self.load_source(source, format, trust_pipe_commands) for source in settings]
        self.sources = [self.checked_shards(source, verify_checksums) for source in loaded]
        self.mixture = Mixture(settings, seed)
        self.global_batch_size, self.micro_batch_size, self.streams = global_batch_size, micro_batch_size, streams
        self.seed, self.num_workers = seed, num_workers
        self.shuffle_buffer, self.pin_memory = shuffle_buffer, pin_memory
        self.val_size, self.val_batch_size = val_size, val_batch_size
        # Workers already tokenize in parallel; Rust threads in forked workers can hang.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.position = DataPosition(self.sources, streams * self.workers)
        self.check_refused_shards()

    def load_source(
        self, source: SourceSettings, format: Callable[..., ExampleFormat[Any]], trust_pipe_commands: bool
    ) -> Source:
        """A source's manifest, checked: a training split, and the sample fields its example format reads
        (`format` with the source's own `fields`). Its shards are checked apart (`checked_shards`)."""
        unknown = sorted(set(source.fields) - set(self.format.field_keys))
        if unknown:
            raise ConfigError(
                f"{source.key}.fields.{unknown[0]}: a source names only its sample fields, which data.format names "
                f"as {', '.join(self.format.field_keys)} (its lengths are the run's)"
            )
        source_format = format(self.tokenizer, **source.fields) if source.fields else self.format
        key, trust = f"{source.key}.dir", trust_pipe_commands
        manifest = Manifest.load(source.dir, check=False, key=key, trust_pipe_commands=trust)
        if not manifest.splits.get("train"):
            raise ShardError(
                f"{source.key}.dir={source.dir}: its manifest ({manifest.directory / MANIFEST}) lists no "
                f"training shards: rebuild them with more data (or a smaller --validation-fraction), or point "
                f"{source.key}.dir at a directory that has them"
            )
        if source.key == "data":
            fields_key = "data.format"
            fix = (
                "set it to one of those (a .json key reads as json:<key>), or choose the data config that matches "
                "these shards (data=text, data=pairs)"
            )
        else:  # a source of a mixture reads data.format's fields, or its own
            fields_key = f"{source.key}.fields" if source.fields else "data.format"
            example = next(iter(source_format.field_keys))
            fix = (
                f"every source of a mixture needs them: give {source.key} its own, ++{source.key}.fields.{example}="
                "<one of those> (a .json key reads as json:<key>)"
            )
        manifest.require_fields([(f"{fields_key}.{key}", name) for key, name in source_format.field_keys.items()], fix)
        return Source(source, manifest, source_format)

    def checked_shards(self, source: Source, verify_checksums: bool) -> Source:
        """A source with its shards checked (sizes, and checksums with `verify_checksums`): one missing or altered
        is refused now under `bad_data=raise`, else skipped when its turn comes, with a warning (`refused`)."""
        if self.bad_data == "raise":
            source.manifest.check(verify_checksums)
            return source
        return dataclasses.replace(source, refused=source.manifest.problems(verify_checksums))

    @property
    def weights(self) -> dict[str, float]:
        return self.position.weights

    @property
    def data_version(self) -> str:
        return self.position.data_version

    # What the callbacks read of the position (`pretraining.data.contract.TrainingData`).
    @property
    def batches_consumed(self) -> int:
        return self.position.batches_consumed

    @property
    def samples_read(self) -> int:
        return self.position.samples_read

    @property
    def samples_skipped(self) -> int:
        return self.position.samples_skipped

    @property
    def drawn(self) -> list[int]:
        return self.position.drawn

    @property
    def ran_out(self) -> set[int]:
        return self.position.ran_out

    def stop_reason(self, ran_out: list[bool]) -> str | None:
        return self.position.stop_reason(ran_out)

    @property
    def mixture_settings(self) -> dict[str, dict[str, Any]] | None:
        """What decides the mixture besides the data (None for one source): each source's weight, cap and
        policy. A resume with other settings is a change of mixture (`resume_allow=[mixture]`)."""
        if len(self.sources) == 1:
            return None
        return {
            source.name: {key: getattr(source.settings, key) for key in ("weight", "max_epochs", "exhausted")}
            | {"fields": source.format.field_keys}
            for source in self.sources
        }

    @property
    def lineage(self) -> dict[str, Any]:
        """What a checkpoint's lineage records of the data besides its version: the data topology, each
        source's directory and version, and for a mixture its settings and phases."""
        sources = {
            source.name: {"dir": source.settings.dir, "version": source.manifest.version} for source in self.sources
        }
        mixture = self.mixture_settings
        phases = {"mixture_phases": self.position.phases} if mixture else {}
        return {"topology": self.topology, "sources": sources, "mixture": mixture, **phases}

    @property
    def train_samples(self) -> int:
        return sum(shard.samples for source in self.sources for shard in source.manifest.shards("train"))

    def check_refused_shards(self) -> None:
        """Warn about each shard refused at start-up (missing or altered), and stop if they hold too much
        of the training data."""
        lost = 0
        for source in self.sources:
            for name, problem in source.refused.items():
                warnings.warn(f"shard {source.manifest.location(name)}: {problem}; it is skipped", stacklevel=2)
            lost += sum(shard.samples for shard in source.manifest.shards("train") if shard.name in source.refused)
        self.check_skips(lost, 0)

    def check_skips(self, skipped: int, read: int) -> None:
        """Stop if more than `max_skip_fraction` of the training samples were skipped: of those read, or,
        while fewer than the training split holds were read, of the split (so that one bad shard read
        early is judged against the whole data, not against the little read so far)."""
        denominator = max(read, self.train_samples)
        if skipped > self.max_skip_fraction * denominator:
            raise ShardError(
                f"{skipped} of {denominator} training samples were skipped as unusable ({skipped / denominator:.2%}), "
                f"more than data.max_skip_fraction={self.max_skip_fraction}: the warnings above name the shards "
                f"and samples; rebuild or remove them (`pretrain-data build`), or raise data.max_skip_fraction. "
                f"The checkpoints saved so far are intact"
            )

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
        """What decides which examples each step trains on, besides the cursors. The number of devices
        is not part of it, only the accumulation that Lightning's loop counts batches with."""
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
        """(step, slot) of the micro-batch consumed last: where it sits in the global batch, the same
        on any number of devices (its randomness is keyed on it too: `seed_step`)."""
        return self.plan.slot_of(self.rank_and_world[0], self.batches_consumed - 1)

    def train_dataloader(self) -> DataLoader:
        """The training micro-batches of this rank, continuing from the data position."""
        rank, _ = self.rank_and_world
        streams = [self.shard_stream(source) for source in self.sources]
        stream = BatchStream(streams, self.plan, rank, self.position.cursors, self.batches_consumed, self.mixture)
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
        return [self.validation_examples(source) for source in self.sources]

    def validation_examples(self, source: Source) -> list[Tensors]:
        shards = [shard for shard in source.manifest.shards("validation") if shard.name not in source.refused]
        urls, documents = [source.manifest.url(shard) for shard in shards], sum(shard.samples for shard in shards)
        chosen = validation_examples(urls, source.format, self.val_size, documents, self.bad_data)
        of = f" of {source.settings.key}" if len(self.sources) > 1 else ""
        rank_zero_info(
            f"validation{of}: {len(chosen.examples)} {self.format.kind} from {chosen.text_bytes:,} bytes of text of "
            f"{chosen.documents} of the {chosen.split_documents} documents of the validation split, "
            f"in {len(shards)} shards"
        )
        return chosen.examples

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """One loader of this rank's validation examples, or for a mixture one per source (in `sources` order:
        the objective reports each, and their weighted mean)."""
        loaders = [self.validation_loader(examples) for examples in self.validation_sets]
        return loaders[0] if len(loaders) == 1 else loaders

    def validation_loader(self, examples: list[Tensors]) -> DataLoader:
        rank, world_size = self.rank_and_world
        per_rank = len(examples) // world_size
        if per_rank == 0:
            raise ShardError(
                f"the validation shards give {len(examples)} {self.format.kind}, fewer than {world_size} ranks; "
                f"build the shards with a larger --validation-fraction"
            )
        # Equal counts on every rank: unequal ones deadlock the metric reduction.
        batch_size = self.val_batch_size or self.plan.micro_batch
        return validation_loader(examples[rank::world_size][:per_rank], batch_size, self.pin_memory)
