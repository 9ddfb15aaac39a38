"""The shard streams: shards -> decoded samples -> examples -> shuffled examples -> micro-batches.

A stream reads an infinite, fixed sequence of shards: the per-epoch shard
permutations (seeded by `seed` and the epoch) are concatenated and dealt
round-robin to the streams. No stream ever runs dry, the epoch is only a
counter, and the k-th shard of a stream is a pure function of (seed, k,
stream, number of streams).

Inside a shard, an `ExampleFormat` (`pretraining.data.formats`) turns the
decoded samples into examples. The examples go through a shuffle buffer
seeded by (seed, epoch, shard) that starts afresh at every shard. So the
examples of a shard, and their order, are a pure function of the shard, and a
batch mixes many documents instead of consecutive pieces of one.

A step's global batch takes the next `global_batch / streams` examples of each
of `data.streams` streams, in stream order (`BatchPlan`); each device runs a
contiguous part of it, in one forward or in several (gradient accumulation).
So the examples of a step depend on the seed, the global batch, the number of
streams and of DataLoader workers, never on the number of devices or the
micro-batch: one process with accumulation trains on exactly what two DDP
processes train on, and each device reads only its own streams (`BatchStream`).

Every example has a `sample_id` naming it by (epoch, shard, position), the same
whatever the layout, so randomness keyed on it (MLM masks) is too. Each
micro-batch carries, for the sub-streams it read, the `Cursor` where they
continue: a consumer that records them can restart every stream exactly
there, skipping whole shards by arithmetic and reading only the current one.

Samples that cannot be used (a missing field, text that is not UTF-8 or is
empty) and shards that cannot be read (truncated, corrupt, missing) are
skipped with a warning naming the shard, the byte offset and the sample, or
stop the run, as the bad-data policy says (`pretraining.data.reader`); each micro-batch
says how many samples were read and skipped while it was made (`read`,
`skipped`). Skipping is deterministic, so the exact resume holds.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from pretraining.data.formats import ExampleFormat, Tensors
from pretraining.data.reader import SampleReader
from pretraining.errors import ConfigError, ShardError

T = TypeVar("T")


@dataclass(frozen=True)
class Cursor:
    """Where a worker's stream continues: after `block` examples of its `shard`-th shard."""

    shard: int = 0
    block: int = 0


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded by a stable hash of `parts` (stable across runs and Pythons)."""
    return random.Random(stable_hash(*parts))


def stable_hash(*parts: object) -> int:
    """A non-negative 63-bit hash of `parts`, the same in every process and Python version."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_shards))
    seeded_rng("shards", seed, epoch).shuffle(order)
    return order


def stream_shard(ordinal: int, stream: int, streams: int, num_shards: int, seed: int) -> tuple[int, int]:
    """(epoch, shard index) of a stream's `ordinal`-th shard."""
    epoch, index = divmod(stream + ordinal * streams, num_shards)
    return epoch, shard_order(num_shards, seed, epoch)[index]


def lengths(format: ExampleFormat[Any]) -> str:
    """The format's lengths as the config keys that set them: `data.format.block_size=256`."""
    return ", ".join(f"data.format.{key}={value}" for key, value in format.lengths.items())


def buffer_shuffled(items: Iterable[T], buffer_size: int, rng: random.Random) -> Iterator[T]:
    """Shuffle a stream through a buffer of `buffer_size` items."""
    buffer: list[T] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


def warn_on_long_documents(
    format: ExampleFormat[Any], samples: Iterable[tuple[str, ...]], shuffle_buffer: int, url: str
) -> Iterator[Any]:
    """The format's examples of a shard's samples, with a warning when one sample (a document) gives more
    examples in a row than the shuffle buffer holds: they then leave it nearly in order."""
    taken = 0

    def counted() -> Iterator[tuple[str, ...]]:
        nonlocal taken
        for sample in samples:
            taken += 1
            yield sample

    run, last = 0, -1
    for example in format.examples(counted()):
        run, last = (run + 1 if taken == last else 1), taken
        if run == shuffle_buffer + 1:
            warnings.warn(
                f"{url}: a document gives more than data.shuffle_buffer={shuffle_buffer} {format.kind} in a row, so "
                f"they are shuffled only within a window of that many and train nearly in order: raise "
                f"data.shuffle_buffer above the {format.kind} of the largest documents, or split those documents",
                stacklevel=2,
            )
        yield example


# --- the streams ------------------------------------------------------------------------------------


class StreamExample(NamedTuple):
    """An example of a stream, the cursor that follows it, its sample id, and how many samples the
    stream read, and skipped as unusable, since the example before it (or since its start)."""

    cursor: Cursor
    sample_id: int
    example: Any
    read: int
    skipped: int


class ShardStream:
    """The examples of the shard streams over `urls`: stream `stream` of `streams` reads a fixed,
    infinite sequence of shards (see module doc) and can restart from any `Cursor`.

    `samples` gives each shard's sample count (to count what a corrupt shard loses); `refused` the
    shards found bad before reading (missing, or not matching their checksum) with the reason: they keep
    their place in the order, so the position arithmetic is unchanged, and are skipped whole when their
    turn comes. `policy` is the bad-data policy (`SampleReader`)."""

    def __init__(
        self,
        urls: Sequence[str],
        format: ExampleFormat[Any],
        seed: int,
        shuffle_buffer: int = 4096,
        samples: Sequence[int] | None = None,
        refused: Mapping[int, str] | None = None,
        policy: str = "skip",
    ) -> None:
        self.urls, self.format, self.seed, self.shuffle_buffer = list(urls), format, seed, shuffle_buffer
        self.samples, self.refused, self.policy = samples, dict(refused or {}), policy

    def examples(self, stream: int, streams: int, start: Cursor) -> Iterator[StreamExample]:
        """The stream's examples from `start` on."""
        reader = SampleReader(self.format.fields, self.policy)
        empty: set[int] = set()  # shards without a whole example (the same in every epoch)
        for ordinal in itertools.count(start.shard):
            if len(empty) == len(self.urls):
                raise ShardError(
                    f"no shard yields a whole example (texts too short for one, or no usable samples: see the "
                    f"warnings); make the examples shorter ({lengths(self.format)}) or rebuild the shards"
                )
            epoch, shard = stream_shard(ordinal, stream, streams, len(self.urls), self.seed)
            samples = self.shard_texts(reader, shard)
            rng = seeded_rng(self.seed, epoch, shard)
            made = warn_on_long_documents(self.format, samples, self.shuffle_buffer, self.urls[shard])
            examples = buffer_shuffled(made, self.shuffle_buffer, rng)
            first = start.block if ordinal == start.shard else 0
            if first:
                collections.deque(itertools.islice(examples, first), maxlen=0)  # consumed before the cursor
                reader.take()  # and so were the samples they counted
            had_example = first > 0
            for index, example in enumerate(examples, start=first + 1):
                had_example = True
                sample_id = stable_hash("sample", epoch, shard, index)
                yield StreamExample(Cursor(ordinal, index), sample_id, example, *reader.take())
            if not had_example:
                empty.add(shard)

    def shard_texts(self, reader: SampleReader, shard: int) -> Iterator[tuple[str, ...]]:
        url, samples = self.urls[shard], self.samples[shard] if self.samples else None
        if shard in self.refused:
            reader.skip_shard(url, samples or 1, self.refused[shard])
            return iter(())
        return reader.texts(url, samples)


@dataclass(frozen=True)
class BatchPlan:
    """How each optimizer step's global batch is read and split over devices (see module doc).

    The global batch is `streams` chunks of `chunk` consecutive examples, one per stream, in stream
    order; slot `s` (one forward on one device) covers its examples `[s * micro_batch, (s + 1) *
    micro_batch)`; rank `r` runs slots `r * accumulation` to `(r + 1) * accumulation - 1`, in turn.
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
    """The plan for `world_size` devices, or a ConfigError naming the one `data.` key to change (and the
    devices only where their number is what breaks it: with one device, the checks that hold on any).

    `micro_batch` None means no accumulation: each device takes its whole share in one forward.
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
    """A rank's infinite sequence of micro-batches, continuing after its first `start` ones.

    Inside DataLoader worker `w` of `n`, it yields the rank's micro-batches `start + w`, `start + w +
    n`, ... (the DataLoader takes them in turn). A stream's chunks at steps congruent to `j` modulo
    `n` are sub-stream `j * streams + stream`: each sub-stream is then always read by the same
    worker, and which examples make a step depends on the loader's worker count, never on the
    number of devices or the micro-batch.
    """

    def __init__(
        self,
        examples: ShardStream,
        plan: BatchPlan,
        rank: int = 0,
        cursors: Mapping[int, Cursor] | None = None,
        start: int = 0,
    ) -> None:
        self.source, self.plan, self.rank = examples, plan, rank
        self.cursors, self.start = dict(cursors or {}), start

    def __iter__(self) -> Iterator[Tensors]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        readers: dict[int, Iterator[StreamExample]] = {}
        plan, total = self.plan, self.plan.streams * workers
        for index in itertools.count(self.start + worker, workers):
            step, slot = plan.slot_of(self.rank, index)
            rows: list[StreamExample] = []
            positions = []
            for stream in plan.streams_of(slot):
                sub = (step % workers) * plan.streams + stream
                if sub not in readers:
                    readers[sub] = self.source.examples(sub, total, self.cursors.get(sub, Cursor()))
                chunk = list(itertools.islice(readers[sub], plan.chunk))
                rows += chunk
                positions.append([sub, chunk[-1].cursor.shard, chunk[-1].cursor.block])
            yield self.collate(rows) | {"positions": torch.tensor(positions)}

    def collate(self, rows: list[StreamExample]) -> Tensors:
        tensors = [self.source.format.tensors(row.example) | {"sample_id": torch.tensor(row.sample_id)} for row in rows]
        counts = {"read": sum(row.read for row in rows), "skipped": sum(row.skipped for row in rows)}
        return default_collate(tensors) | {name: torch.tensor(count) for name, count in counts.items()}


# Validation keeps a multiple of this many examples (of a smaller power of two, if it has fewer): each device
# validates on an equal share, and examples left over would be left out on some numbers of devices, not others.
DEVICE_MULTIPLE = 8


@dataclass(frozen=True)
class ValidationSet:
    """The validation examples (each with its position as `sample_id`), the documents they were made from
    and those of the split, and the UTF-8 bytes of the texts they read."""

    examples: list[Tensors]
    documents: int
    split_documents: int
    text_bytes: int


def shared_alike(count: int) -> int:
    """How many of `count` validation examples to keep: a multiple of `DEVICE_MULTIPLE`, or of the largest
    power of two at most `count`, so that 1, 2, 4 and 8 devices (as many as can) validate on the same examples."""
    if count == 0:
        return 0
    multiple = min(DEVICE_MULTIPLE, 1 << (count.bit_length() - 1))
    return count - count % multiple


def spread(count: int, total: int) -> set[int]:
    """`count` of the indices 0 .. total - 1, evenly spaced (all of them when count >= total)."""
    return {index * total // count for index in range(count)} if count < total else set(range(total))


def validation_examples(
    urls: Sequence[str], format: ExampleFormat, size: int, split_documents: int, policy: str = "skip"
) -> ValidationSet:
    """A fixed sample spread over the whole validation split of `split_documents` documents (samples): up
    to `size` of them, evenly spaced (every one where the split has no more), the format's `validation_texts`
    of those (packed text takes a window of each, within a budget), made into examples."""
    chosen = spread(min(size, split_documents), split_documents)
    samples = itertools.islice(SampleReader(format.fields, policy).all_texts(urls), max(chosen, default=-1) + 1)
    documents = [sample for index, sample in enumerate(samples) if index in chosen]
    if len(documents) < len(chosen):
        warnings.warn(
            f"validation reads {len(documents)} of the {len(chosen)} documents it chose: the validation shards hold "
            f"fewer usable samples than their manifest counts (see the bad-data warnings)",
            stacklevel=2,
        )
    choose = getattr(format, "validation_texts", None)  # optional (not in the Protocol): a format's own budget
    texts = choose(documents, size) if choose else documents
    made = list(itertools.islice(format.examples(texts), size))
    made = [made[index] for index in sorted(spread(shared_alike(len(made)), len(made)))]  # left out: spread too
    examples = [format.tensors(example) | {"sample_id": torch.tensor(index)} for index, example in enumerate(made)]
    text_bytes = sum(len(field.encode()) for text in texts for field in text)
    return ValidationSet(examples, len(documents), split_documents, text_bytes)
