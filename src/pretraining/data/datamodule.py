"""The LightningDataModule over a shard directory with a manifest, whatever its examples: the example
format that `data.format` names (`pretraining.data.formats`) makes them.

The batch is configured globally: `global_batch_size` examples (or
`global_batch_tokens`) per optimizer step over all devices, run in
micro-batches of `micro_batch_size` per device; the gradient accumulation
follows from the number of devices (`plan`), and so do the examples each
device reads (`pretraining.data.batches.BatchPlan`): the same config trains on
the same examples, step by step, on any number of devices.

The DataModule also owns the training data position. It sees every batch the
training loop consumes (`on_before_batch_transfer`, which runs on consumed
batches, not on the ones the loop prefetches) and keeps the cursor where each
of its streams continues, plus the number of micro-batches consumed.
`state_dict()` gathers the cursors of every rank, so rank zero's checkpoint
holds all of them, and `train_dataloader()` always starts from them: after a
restore, each stream skips its finished shards by arithmetic and re-reads only
its current shard, whatever the number of devices now.

It keys the randomness of training on the same position: before each training
micro-batch it seeds every generator from (seed, step, slot), the micro-batch's
place in the step's global batch, the same on any number of devices. Dropout
and any other draw of a step then depend only on where the run is, not on its
history or layout: a run resumed from a checkpoint draws exactly what the
uninterrupted run drew, whatever happened in between (validation, a sample, a
restart), and one process accumulating gradients draws what several devices
draw. (Per-sample randomness in the data, MLM masks, is keyed on sample ids.)

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
import hashlib
import json
import os
import random
import warnings
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Annotated, Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from pretraining.data.batches import BatchPlan, BatchStream, batch_plan, default_streams, global_batch_examples
from pretraining.data.formats import ExampleFormat, Tensors
from pretraining.data.loader import training_loader, validation_loader
from pretraining.data.manifest import MANIFEST, Manifest
from pretraining.data.mixture import Mixture, Source, SourceSettings, source_settings
from pretraining.data.stream import Cursor, ShardStream, stable_hash
from pretraining.data.tokenizer import Tokenizer
from pretraining.data.validation import validation_examples
from pretraining.distributed import gather
from pretraining.errors import CheckpointError, ConfigError, ShardError
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

    STATE_FORMAT = 3  # 2: one source, cursors [sub, shard, block] (read as a mixture of one)

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
        self.batches_consumed = 0  # training micro-batches this rank has consumed
        self.cursors: dict[tuple[int, int], Cursor] = {}  # where each (source, sub-stream) this rank reads continues
        self.samples_read = self.samples_skipped = 0  # by the training batches this rank consumed
        self.drawn = [0] * len(self.sources)  # examples each source gave the training batches this rank consumed
        self.ran_out: set[int] = set()  # the sources that have run out (max_epochs) in a sub-stream this rank reads
        self.stopped_by: dict[str, int | None] = {}  # the sources whose running out stopped the run, with their caps
        self.phases = [{"step": 0, "weights": self.weights}]  # the mixture's weights, from the step each took effect
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
        return {source.name: source.weight for source in self.sources}

    @property
    def data_version(self) -> str:
        """The version of the data: the manifest's for one source; for a mixture, a hash of its sources'
        names and versions (the weights are the mixture's, `mixture_settings`, compared apart on resume)."""
        if len(self.sources) == 1:
            return self.sources[0].manifest.version
        versions = {source.name: source.manifest.version for source in self.sources}
        return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]

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
        phases = {"mixture_phases": self.phases} if mixture else {}
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
        stream = BatchStream(streams, self.plan, rank, self.cursors, self.batches_consumed, self.mixture)
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
            for source, sub, shard, block in batch.pop("positions").tolist():
                self.cursors[source, sub] = Cursor(shard, block)
            for source, drawn in enumerate(batch.pop("drawn").tolist()):
                self.drawn[source] += drawn
            self.ran_out |= {source for source, out in enumerate(batch.pop("ran_out").tolist()) if out}
            self.batches_consumed += 1
            self.samples_read += int(batch.pop("read"))
            self.samples_skipped += int(batch.pop("skipped"))
            seed_step(stable_hash("batch", self.seed, *self.batch_slot))
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The data position of every rank (a collective under DDP/FSDP: every rank calls it on save)."""
        ranks = gather((self.cursors, self.samples_read, self.samples_skipped, self.drawn, self.ran_out))
        cursors = {key: cursor for rank_cursors, *_ in ranks for key, cursor in rank_cursors.items()}
        names = [source.name for source in self.sources]
        return {
            "format": self.STATE_FORMAT,
            "data_version": self.data_version,
            "versions": {source.name: source.manifest.version for source in self.sources},
            "topology": self.topology,
            "steps": self.batches_consumed // self.plan.accumulation,
            "cursors": [[names[source], sub, c.shard, c.block] for (source, sub), c in sorted(cursors.items())],
            "samples_read": sum(read for _, read, *_ in ranks),
            "samples_skipped": sum(skipped for _, _, skipped, *_ in ranks),
            "drawn": {name: sum(rank[3][index] for rank in ranks) for index, name in enumerate(names)},
            # Each source that ran out, with the cap it ran out at.
            "ran_out": {names[index]: self.sources[index].settings.max_epochs for *_, out in ranks for index in out},
            "stopped_by": self.stopped_by,
            "phases": self.phases,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: each source whose data is unchanged from its cursors, exactly if the
        topology is unchanged, else approximately; a source that changed, or is new, from its start (the
        caller decides whether a change is allowed: see `pretraining.resume`). New mixture weights take effect
        from the saved step, which starts a phase."""
        state = self.in_current_format(state)
        steps = state["steps"]
        self.batches_consumed = steps * self.plan.accumulation
        # The run's totals, on rank zero only: summed over ranks, they stay the totals.
        first = self.rank_and_world[0] == 0
        self.samples_read = state["samples_read"] if first else 0
        self.samples_skipped = state["samples_skipped"] if first else 0
        self.drawn = [state["drawn"].get(source.name, 0) if first else 0 for source in self.sources]
        self.phases = list(state["phases"])
        self.ran_out = self.still_run_out(state.get("ran_out", {}), state.get("stopped_by", {}))
        if self.phases[-1]["weights"] != self.weights:
            self.phases.append({"step": steps, "weights": self.weights})
            if len(self.sources) > 1:
                rank_zero_info(f"data.sources: the weights {self.weights} take effect at step {steps}")
        index = {source.name: number for number, source in enumerate(self.sources)}
        unchanged = {
            name
            for name, version in state["versions"].items()
            if name in index and self.sources[index[name]].manifest.version == version
        }
        for source in self.sources:
            if source.name not in unchanged:
                warnings.warn(
                    f"the shards of {source.settings.key}.dir are not the checkpoint's: they are read from their start",
                    stacklevel=1,
                )
        saved = {
            (index[name], sub): Cursor(shard, block)
            for name, sub, shard, block in state["cursors"]
            if name in unchanged
        }
        if state["topology"] == self.topology:
            self.cursors = self.own(saved)
            return
        # Every sub-stream of a source starts at the same ordinal: the shards the old run finished of it,
        # counted over all its sub-streams, shared out among the new ones (rounded up). Approximate: a shard in
        # progress then may be skipped or read again from its start.
        sub_streams = self.streams * self.workers
        starts = {}
        for number in range(len(self.sources)):
            done = sum(cursor.shard for (source, _), cursor in saved.items() if source == number)
            starts[number] = Cursor(-(-done // sub_streams))
        by_source = " (by source)" if len(starts) > 1 else ""
        warnings.warn(
            f"data topology changed from {state['topology']} to {self.topology}: the stream resumes approximately, at "
            f"shard {', '.join(str(start.shard) for start in starts.values())} of every stream{by_source}",
            stacklevel=1,
        )
        self.cursors = self.own(
            {(number, sub): start for number, start in starts.items() for sub in range(sub_streams)}
        )

    def still_run_out(self, ran_out: dict[str, int], stopped_by: dict[str, int]) -> set[int]:
        """The sources that ran out before the checkpoint and still have the cap they ran out at; one that
        stopped the run there (`stopped_by`, not merely run out before the step that stops) refuses to
        continue it."""
        still = {
            index
            for index, source in enumerate(self.sources)
            if ran_out.get(source.name, 0) == source.settings.max_epochs
        }
        stopped = [self.sources[index].settings for index in sorted(still) if self.sources[index].name in stopped_by]
        stopped = [source for source in stopped if source.exhausted == "stop"]
        if stopped:
            keys = ", ".join(source.key for source in stopped)
            raise ShardError(
                f"{keys} ran out before this checkpoint (max_epochs) and stopped the run: to continue it, raise "
                f"{stopped[0].key}.max_epochs (or pass ++{stopped[0].key}.exhausted=renormalise to go on without it), "
                f"with resume_allow=[mixture]"
            )
        return still

    def stop_reason(self, ran_out: list[bool]) -> str | None:
        """Why the run stops at this step, if it does: a source with `exhausted: stop` ran out, on any rank
        (`ran_out`: each source, over all ranks)."""
        stopped = [source.settings for source, out in zip(self.sources, ran_out, strict=True) if out]
        stopped = [source for source in stopped if source.exhausted == "stop"]
        if not stopped:
            return None
        self.stopped_by = {source.name: source.max_epochs for source in stopped}
        source = stopped[0]
        return (
            f"{source.key} has run out: its shards were read max_epochs={source.max_epochs} times, and its share "
            f"filled by the other sources since (at most trainer.log_every_n_steps steps); saving and stopping "
            f"({source.key}.exhausted=stop). To go on, raise {source.key}.max_epochs, or pass ++{source.key}.exhausted="
            f"renormalise, and continue with resume_allow=[mixture]"
        )

    def in_current_format(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved position in this code's format. One source's position (format 2, or a source renamed with
        its directory) continues this run's one source."""
        if state.get("format") not in (2, self.STATE_FORMAT):
            raise CheckpointError(
                f"the checkpoint's data position has format {state.get('format')}, this code reads "
                f"{self.STATE_FORMAT}: resume it with the code revision that wrote it"
            )
        if state["format"] == 2:  # one directory's, unnamed: `renamed` gives it this run's name
            state = state | {
                "versions": {"": state["data_version"]},
                "cursors": [["", *cursor] for cursor in state["cursors"]],
                "drawn": {"": state["steps"] * self.global_batch_size},
                "phases": [{"step": 0, "weights": {"": 1.0}}],
            }
        state = self.renamed(state)
        if len(self.sources) == 1:  # a mixture of one draws from it whatever its weight: one phase, this run's
            state = state | {"phases": [{"step": 0, "weights": self.weights}]}
        return state

    def renamed(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved position under this run's source names: a saved source this run does not name is the
        run's one source of the same version (a `data.dir` run continued as a mixture, a source renamed), or,
        where the checkpoint and the run have one source each, the run's source."""
        current = {source.name: source.manifest.version for source in self.sources}
        free = {name: version for name, version in current.items() if name not in state["versions"]}
        mapping = {}
        for name, version in state["versions"].items():
            same = [new for new, new_version in free.items() if new_version == version]
            if name not in current and len(same) == 1:
                mapping[name] = same[0]
                del free[same[0]]
        if len(state["versions"]) == len(self.sources) == 1 and not mapping and not state["versions"].keys() & current:
            mapping = {next(iter(state["versions"])): self.sources[0].name}
        if not mapping:
            return state

        def by_new_name(entries: dict[str, Any]) -> dict[str, Any]:
            return {mapping.get(name, name): value for name, value in entries.items()}

        return state | {
            "versions": by_new_name(state["versions"]),
            "cursors": [[mapping.get(name, name), *rest] for name, *rest in state["cursors"]],
            "drawn": by_new_name(state["drawn"]),
            "ran_out": by_new_name(state.get("ran_out", {})),
            "stopped_by": by_new_name(state.get("stopped_by", {})),
            "phases": [phase | {"weights": by_new_name(phase["weights"])} for phase in state["phases"]],
        }

    def own(self, cursors: dict[tuple[int, int], Cursor]) -> dict[tuple[int, int], Cursor]:
        """The cursors of the sub-streams this rank reads (each rank saves only its own, so that the
        gathered position holds each sub-stream's cursor from the one rank that moves it)."""
        mine = self.plan.streams_of_rank(self.rank_and_world[0])
        return {(source, sub): cursor for (source, sub), cursor in cursors.items() if sub % self.streams in mine}

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


def seed_step(seed: int) -> None:
    """Seed Python's `random`, NumPy and torch (the CPU, every CUDA device, Apple's GPU): what
    `torch.manual_seed` does for the devices Lightning trains on, without its look for every other backend,
    which would cost a small model's step more than the rest of the seeding."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # a run on the GPU has started CUDA before its first batch
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)
