"""The shard streams: shards -> decoded samples -> examples -> shuffled examples.

A stream reads an infinite, fixed sequence of shards: the per-epoch shard permutations (seeded by `seed` and
the epoch) concatenated and dealt round-robin to the streams, so the k-th shard of a stream is a pure function
of (seed, k, stream, number of streams). Inside a shard, the `ExampleFormat` makes examples, shuffled by a
buffer seeded by (seed, epoch, shard) that starts afresh at every shard: a shard's examples and their order
depend only on the shard, and a batch mixes many documents.

Every example carries a `sample_id` (epoch, shard, position: the same whatever the layout, so MLM masks keyed
on it are too) and the `Cursor` where its stream continues, from which it restarts exactly, skipping whole
shards by arithmetic. Bad data is skipped or stops the run (`pretraining.data.reader`), deterministically,
so the exact resume holds; each sample counts at its shard's first epoch only.
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

from pretraining.data.formats import ExampleFormat
from pretraining.data.reader import SampleReader
from pretraining.errors import ShardError

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
    """The format's examples of a shard's samples, warning when one document gives more in a row than the
    shuffle buffer holds (they then train nearly in order)."""
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
    """An example of a stream, the cursor after it, its sample id, and the samples read and skipped since the
    example before it."""

    cursor: Cursor
    sample_id: int
    example: Any
    read: int
    skipped: int


class ShardStream:
    """The examples of the shard streams over `urls`, each restartable from any `Cursor` (see module doc).
    `samples`: each shard's count (what a corrupt one loses); `refused`: shards found bad at start-up, which
    keep their place in the order (the position arithmetic holds) and are skipped whole. With `max_epochs`, a
    stream ends before that epoch. `source` enters the sample ids, so two sources' never collide."""

    def __init__(
        self,
        urls: Sequence[str],
        format: ExampleFormat[Any],
        seed: int,
        shuffle_buffer: int = 4096,
        samples: Sequence[int] | None = None,
        refused: Mapping[int, str] | None = None,
        policy: str = "skip",
        max_epochs: int | None = None,
        source: str = "",
    ) -> None:
        self.urls, self.format, self.seed, self.shuffle_buffer = list(urls), format, seed, shuffle_buffer
        self.samples, self.refused, self.policy = samples, dict(refused or {}), policy
        self.max_epochs = max_epochs
        self.id_parts = (source,) if source else ()

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
            if self.max_epochs is not None and epoch >= self.max_epochs:
                return
            samples = self.shard_texts(reader, shard, again=epoch > 0)
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
                sample_id = stable_hash("sample", *self.id_parts, epoch, shard, index)
                yield StreamExample(Cursor(ordinal, index), sample_id, example, *reader.take())
            if not had_example:
                empty.add(shard)

    def shard_texts(self, reader: SampleReader, shard: int, again: bool) -> Iterator[tuple[str, ...]]:
        url, samples = self.urls[shard], self.samples[shard] if self.samples else None
        if shard in self.refused:
            reader.skip_shard(url, samples or 1, self.refused[shard], again)
            return iter(())
        return reader.texts(url, samples, again)
