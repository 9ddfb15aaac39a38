"""A step's global batch, read from the shard streams and shared out over devices and micro-batches.

A step takes the next `global_batch / streams` examples of each of `data.streams` streams, in stream order;
each device runs a contiguous part of it. So a step's examples never depend on the number of devices or the
micro-batch: one process with accumulation trains on exactly what two DDP processes do. Each micro-batch
carries the position it moved (`positions`, `drawn`, `ran_out`, `read`, `skipped`: `DataPosition.advance`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from pretraining.data.formats import ExampleFormat, Tensors
from pretraining.data.mixture import MixedExamples, Mixture, SourceSettings
from pretraining.data.stream import Cursor, ShardStream, StreamExample
from pretraining.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How a step's global batch is read and split: `streams` chunks of `chunk` examples; slot `s` (one forward
    on one device) covers examples `[s * micro_batch, (s + 1) * micro_batch)`; rank `r` runs slots
    `r * accumulation` to `(r + 1) * accumulation - 1`, in turn.
    """

    global_batch: int
    micro_batch: int
    streams: int
    world_size: int = 1

    @property
    def chunk(self) -> int:
        return self.global_batch // self.streams

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.world_size * self.micro_batch)

    def slot_of(self, rank: int, index: int) -> tuple[int, int]:
        """(step, slot) of a rank's `index`-th micro-batch."""
        step, accumulated = divmod(index, self.accumulation)
        return step, rank * self.accumulation + accumulated

    def streams_of(self, slot: int) -> range:
        per_slot = self.micro_batch // self.chunk
        return range(slot * per_slot, (slot + 1) * per_slot)

    def streams_of_rank(self, rank: int) -> range:
        per_rank = self.streams // self.world_size
        return range(rank * per_rank, (rank + 1) * per_rank)


def batch_plan(global_batch: int, micro_batch: int | None, streams: int, world_size: int) -> BatchPlan:
    """The plan for `world_size` devices, or a ConfigError naming the `data.` key to change (with one device,
    the checks that hold on any). `micro_batch` None: no accumulation.
    """
    devices = f"the {world_size} devices" if world_size > 1 else "1 device"
    if global_batch % world_size:
        raise ConfigError(
            f"data.global_batch_size={global_batch} is not divisible by {devices}: make it a multiple of "
            f"{world_size} or run on a number of devices that divides it"
        )
    per_device = global_batch // world_size
    micro = micro_batch or per_device
    if per_device % micro:
        share = f"over {devices} is {per_device} per device, " if world_size > 1 else ""
        raise ConfigError(
            f"data.global_batch_size={global_batch} {share}not a multiple of data.micro_batch_size={micro}: "
            f"choose a micro-batch that divides {per_device}"
        )
    if global_batch % streams:
        raise ConfigError(
            f"data.streams={streams} does not divide data.global_batch_size={global_batch} (each stream gives a step "
            f"the same number of examples): change data.streams or the global batch"
        )
    if streams % world_size:
        raise ConfigError(
            f"data.streams={streams} is not a multiple of {devices} (each device reads its own streams): "
            f"change data.streams to a multiple of {world_size} that divides data.global_batch_size={global_batch}"
        )
    if micro % (global_batch // streams):
        raise ConfigError(
            f"data.micro_batch_size={micro} must be a multiple of the {global_batch // streams} examples each of "
            f"the data.streams={streams} streams gives a step: raise data.streams or the micro-batch"
        )
    return BatchPlan(global_batch, micro, streams, world_size)


class BatchStream(IterableDataset):
    """A rank's infinite micro-batches after its first `start`, drawn from the sources as the mixture says.
    Worker `w` of `n` yields micro-batches `start + w`, `start + w + n`, ...; a stream's chunks at steps `j`
    modulo `n` are sub-stream `j * streams + stream`, so each sub-stream is always read by the same worker.
    """

    def __init__(
        self,
        streams: Sequence[ShardStream],
        plan: BatchPlan,
        rank: int = 0,
        cursors: Mapping[tuple[int, int], Cursor] | None = None,
        start: int = 0,
        mixture: Mixture | None = None,
    ) -> None:
        self.streams, self.plan, self.rank = streams, plan, rank
        self.cursors, self.start = dict(cursors or {}), start
        self.mixture = mixture or Mixture([SourceSettings("data", "")], seed=0)  # None: one source

    def __iter__(self) -> Iterator[Tensors]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan = self.plan
        examples = MixedExamples(self.streams, self.mixture, plan.streams * workers, self.cursors)
        for index in itertools.count(self.start + worker, workers):
            step, slot = plan.slot_of(self.rank, index)
            rows: list[StreamExample] = []
            positions: dict[tuple[int, int], Cursor] = {}
            drawn = [0] * len(self.streams)
            for stream in plan.streams_of(slot):
                sub = (step % workers) * plan.streams + stream
                first = step * plan.global_batch + stream * plan.chunk  # the run's index of the chunk's first example
                for example in range(first, first + plan.chunk):
                    source, row = examples.next(sub, example, step)
                    rows.append(row)
                    positions[source, sub] = row.cursor
                    drawn[source] += 1
            cursors = [[source, sub, cursor.shard, cursor.block] for (source, sub), cursor in positions.items()]
            sources = {"drawn": torch.tensor(drawn), "ran_out": torch.tensor(examples.ran_out)}
            yield self.collate(rows) | {"positions": torch.tensor(cursors)} | sources

    def collate(self, rows: list[StreamExample]) -> Tensors:
        tensors = [self.format.tensors(row.example) | {"sample_id": torch.tensor(row.sample_id)} for row in rows]
        counts = {"read": sum(row.read for row in rows), "skipped": sum(row.skipped for row in rows)}
        return default_collate(tensors) | {name: torch.tensor(count) for name, count in counts.items()}

    @property
    def format(self) -> ExampleFormat[Any]:
        return self.streams[0].format


def global_batch_examples(examples: int | None, tokens: int | None, example_tokens: int) -> int:
    """The global batch in examples, from exactly one of its size in examples and in tokens."""
    if examples is not None and tokens is None:
        return examples
    if tokens is not None and examples is None:
        if tokens % example_tokens:
            raise ConfigError(
                f"data.global_batch_tokens={tokens} must be a multiple of the {example_tokens} tokens of one example "
                f"(data.format's lengths)"
            )
        return tokens // example_tokens
    raise ConfigError(
        f"set exactly one of data.global_batch_size (examples) and data.global_batch_tokens; got {examples} and "
        f"{tokens} (set the other to null)"
    )


def default_streams(global_batch: int) -> int:
    """`data.streams` when null: the largest of 1, 2, 4 and 8 dividing the global batch, from the batch alone
    so that the data order never depends on the number of devices."""
    return math.gcd(global_batch, 8)
