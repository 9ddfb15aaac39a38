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

Bad data follows `bad_data`: `skip` (the default) skips unusable samples and
shards with a warning and counts them (`samples_read`, `samples_skipped`, kept in
the checkpoint with the position); `raise` stops on the first. A shard missing
or altered at start-up keeps its place in the stream order and is skipped
whole. `check_skips` stops the run once too much was skipped
(`pretraining.callbacks.skipped_samples.SkippedSamples` calls it with the totals of all ranks).
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable
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
from pretraining.data.manifest import Manifest
from pretraining.data.stream import Cursor, ShardStream, stable_hash
from pretraining.data.tokenizer import Tokenizer
from pretraining.data.validation import validation_examples
from pretraining.distributed import gather
from pretraining.errors import CheckpointError, ShardError
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

    STATE_FORMAT = 2

    @checked_ranges("data")
    def __init__(
        self,
        dir: str,
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
    ) -> None:
        super().__init__()
        self.tokenizer, self.format = tokenizer, format(tokenizer)
        global_batch_size = global_batch_examples(global_batch_size, global_batch_tokens, self.format.example_tokens)
        streams = streams or default_streams(global_batch_size)
        batch_plan(global_batch_size, micro_batch_size, streams, 1)  # a config error shows before any work
        self.bad_data, self.max_skip_fraction = bad_data, max_skip_fraction
        self.manifest = Manifest.load(
            dir, verify_checksums, check=bad_data == "raise", key="data.dir", trust_pipe_commands=trust_pipe_commands
        )
        self.refused = self.manifest.problems(verify_checksums) if bad_data == "skip" else {}
        self.manifest.require_fields(
            [(f"data.format.{key}", name) for key, name in self.format.field_keys.items()],
            "set it to one of those (a .json key reads as json:<key>), or choose the data config that matches these "
            "shards (data=text, data=pairs)",
        )
        self.global_batch_size, self.micro_batch_size, self.streams = global_batch_size, micro_batch_size, streams
        self.seed, self.num_workers = seed, num_workers
        self.shuffle_buffer, self.pin_memory = shuffle_buffer, pin_memory
        self.val_size, self.val_batch_size = val_size, val_batch_size
        # Workers already tokenize in parallel; Rust threads in forked workers can hang.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.batches_consumed = 0  # training micro-batches this rank has consumed
        self.cursors: dict[int, Cursor] = {}  # where each sub-stream this rank has read continues
        self.samples_read = self.samples_skipped = 0  # by the training batches this rank consumed
        self.check_refused_shards()

    @property
    def train_samples(self) -> int:
        return sum(shard.samples for shard in self.manifest.shards("train"))

    def check_refused_shards(self) -> None:
        """Warn about each shard refused at start-up (missing or altered), and stop if they hold too much
        of the training data."""
        for name, problem in self.refused.items():
            warnings.warn(f"shard {self.manifest.location(name)}: {problem}; it is skipped", stacklevel=2)
        lost = sum(shard.samples for shard in self.manifest.shards("train") if shard.name in self.refused)
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
        shards = self.manifest.shards("train")
        refused = {index: self.refused[shard.name] for index, shard in enumerate(shards) if shard.name in self.refused}
        samples = [shard.samples for shard in shards]
        examples = ShardStream(
            self.manifest.urls("train"), self.format, self.seed, self.shuffle_buffer, samples, refused, self.bad_data
        )
        sub_streams = self.streams * self.workers
        if len(shards) < sub_streams:
            warnings.warn(
                f"{len(shards)} training shards for {sub_streams} sub-streams (data.streams x data.num_workers): "
                f"several sub-streams read the same shard at once, so a step can repeat examples; build more, "
                f"smaller shards (`pretrain-data build --shard-bytes`) or lower data.streams",
                stacklevel=2,
            )
        stream = BatchStream(examples, self.plan, rank, self.cursors, self.batches_consumed)
        return training_loader(stream, self.num_workers, self.pin_memory)

    def on_before_batch_transfer(self, batch: Tensors, dataloader_idx: int) -> Tensors:
        if "positions" in batch:  # a training batch (validation has none): it advances the position
            for sub, shard, block in batch.pop("positions").tolist():
                self.cursors[sub] = Cursor(shard, block)
            self.batches_consumed += 1
            self.samples_read += int(batch.pop("read"))
            self.samples_skipped += int(batch.pop("skipped"))
            seed_step(stable_hash("batch", self.seed, *self.batch_slot))
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The data position of every rank (a collective under DDP/FSDP: every rank calls it on save)."""
        ranks = gather((self.cursors, self.samples_read, self.samples_skipped))
        cursors = {sub: [c.shard, c.block] for rank_cursors, _, _ in ranks for sub, c in rank_cursors.items()}
        return {
            "format": self.STATE_FORMAT,
            "data_version": self.manifest.version,
            "topology": self.topology,
            "steps": self.batches_consumed // self.plan.accumulation,
            "cursors": [[sub, *cursor] for sub, cursor in sorted(cursors.items())],
            "samples_read": sum(read for _, read, _ in ranks),
            "samples_skipped": sum(skipped for _, _, skipped in ranks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: exactly if the topology is unchanged, else approximately
        (the caller decides whether a change is allowed: see `pretraining.resume`)."""
        if state.get("format") != self.STATE_FORMAT:
            raise CheckpointError(
                f"the checkpoint's data position has format {state.get('format')}, this code reads "
                f"{self.STATE_FORMAT}: resume it with the code revision that wrote it"
            )
        self.batches_consumed = state["steps"] * self.plan.accumulation
        # The run's totals, on rank zero only: summed over ranks, they stay the totals.
        first = self.rank_and_world[0] == 0
        self.samples_read = state.get("samples_read", 0) if first else 0
        self.samples_skipped = state.get("samples_skipped", 0) if first else 0
        if state["data_version"] != self.manifest.version:
            warnings.warn("the data changed since the checkpoint: the new data is read from its start", stacklevel=1)
            self.cursors = {}
            return
        saved = {sub: Cursor(shard, block) for sub, shard, block in state["cursors"]}
        if state["topology"] == self.topology:
            self.cursors = self.own(saved)
            return
        # Every sub-stream starts at the same ordinal: the shards the old run finished, counted over all
        # its sub-streams, shared out among the new ones (rounded up). Approximate: a shard in progress
        # then may be skipped or read again from its start.
        done = sum(cursor.shard for cursor in saved.values())
        start = Cursor(-(-done // (self.streams * self.workers)))
        warnings.warn(
            f"data topology changed from {state['topology']} to {self.topology}: the stream resumes approximately, "
            f"at shard {start.shard} of every stream, after about {done} shards",
            stacklevel=1,
        )
        self.cursors = self.own(dict.fromkeys(range(self.streams * self.workers), start))

    def own(self, cursors: dict[int, Cursor]) -> dict[int, Cursor]:
        """The cursors of the sub-streams this rank reads (each rank saves only its own, so that the
        gathered position holds each sub-stream's cursor from the one rank that moves it)."""
        mine = self.plan.streams_of_rank(self.rank_and_world[0])
        return {sub: cursor for sub, cursor in cursors.items() if sub % self.streams in mine}

    @cached_property
    def validation_set(self) -> list[Tensors]:
        """All ranks' validation examples, read once however often validation runs."""
        shards = [shard for shard in self.manifest.shards("validation") if shard.name not in self.refused]
        urls, documents = [self.manifest.url(shard) for shard in shards], sum(shard.samples for shard in shards)
        chosen = validation_examples(urls, self.format, self.val_size, documents, self.bad_data)
        rank_zero_info(
            f"validation: {len(chosen.examples)} {self.format.kind} from {chosen.text_bytes:,} bytes of text of "
            f"{chosen.documents} of the {chosen.split_documents} documents of the validation split, "
            f"in {len(shards)} shards"
        )
        return chosen.examples

    def val_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world
        examples = self.validation_set
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
