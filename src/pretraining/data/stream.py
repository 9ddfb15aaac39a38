"""The shard stream: shards -> decoded samples -> examples -> shuffled examples.

Every global worker (rank x DataLoader worker) reads an infinite, fixed
sequence of shards: the per-epoch shard permutations (seeded by `seed` and the
epoch, the same on every rank) are concatenated and dealt round-robin to the
global workers. No worker ever runs dry, the epoch is only a counter, and the
k-th shard of a worker is a pure function of (seed, k, worker, world size,
workers).

Inside a shard, an `ExampleFormat` turns the decoded samples into examples:
`PackedBlocks` tokenises documents and packs them into fixed-size blocks,
`TokenizedPairs` tokenises (query, passage) pairs. The examples go through a
shuffle buffer seeded by (seed, epoch, shard) that starts afresh at every
shard. So the examples of a shard, and their order, are a pure function of the
shard, and a batch mixes many documents instead of consecutive pieces of one.

Each example carries its worker, the `Cursor` where that worker's stream
continues, and a `sample_id` naming it by (epoch, shard, position): the same
whatever the world size or worker count, so randomness keyed on it (MLM
masks) is too. A consumer that records the cursor of every example it trains
on can restart the stream exactly there: whole shards are skipped by
arithmetic and only the current shard is read again.

Samples that cannot be used (a missing field, text that is not UTF-8 or is
empty) are skipped with a warning naming the shard and the sample; every
example says how many were skipped just before it (`skipped`), so the
consumer can count them exactly.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from pretraining.data.corpus import PAIR_FIELDS, TEXT_FIELDS
from pretraining.data.tokenizer import CLS_ID, EOS_ID, PAD_ID, Tokenizer

T = TypeVar("T")
Example = TypeVar("Example")
Tensors = dict[str, torch.Tensor]


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


def worker_shard(ordinal: int, global_worker: int, global_workers: int, num_shards: int, seed: int) -> tuple[int, int]:
    """(epoch, shard index) of a global worker's `ordinal`-th shard."""
    epoch, index = divmod(global_worker + ordinal * global_workers, num_shards)
    return epoch, shard_order(num_shards, seed, epoch)[index]


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


def read_shard(url: str) -> Iterator[dict[str, Any]]:
    """Raw samples of one tar shard (local path, URL or `pipe:` command), undecoded."""
    return wds.tariterators.tarfile_samples([{"url": url}])


def sample_texts(sample: dict[str, Any], fields: Sequence[str]) -> tuple[str, ...] | str:
    """The sample's texts for `fields`, or the reason it cannot be used."""
    texts = []
    for name in fields:
        if name not in sample:
            return f"no {name!r} field"
        try:
            text = sample[name].decode("utf-8")
        except UnicodeDecodeError:
            return f"{name!r} is not UTF-8"
        if not text.strip():
            return f"{name!r} is empty"
        texts.append(text)
    return tuple(texts)


class SkipCounter:
    """Decodes samples, dropping the unusable ones with a warning, and counts them."""

    def __init__(self) -> None:
        self.pending = 0  # skipped since the last example handed out

    def decoded(self, urls: Iterable[str], fields: Sequence[str]) -> Iterator[tuple[str, ...]]:
        for url in urls:
            for sample in read_shard(url):
                texts = sample_texts(sample, fields)
                if isinstance(texts, str):
                    self.pending += 1
                    warnings.warn(f"skipped sample {sample.get('__key__')!r} of {url}: {texts}", stacklevel=1)
                    continue
                yield texts

    def take(self) -> int:
        pending, self.pending = self.pending, 0
        return pending


class ExampleFormat(Protocol[Example]):
    """How a shard's decoded samples become training examples."""

    fields: tuple[str, ...]  # the sample fields it reads, as the manifest records them
    kind: ClassVar[str]  # what the objectives consume: "blocks" or "pairs"
    lengths: dict[str, int]  # the lengths (config keys) that decide how samples become examples

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Example]: ...

    def tensors(self, example: Example) -> Tensors: ...


# --- packed blocks of text ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """`block_size + 1` tokens (one extra so next-token targets stay inside the
    block; consecutive blocks of a document stream share that token, so no
    transition is lost) and the index of each token's document within the block."""

    tokens: list[int]
    doc_ids: list[int]


def encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """A document's tokens followed by the EOS separator."""
    return [*tokenizer.encode(text), EOS_ID]


def pack_blocks(documents: Iterable[list[int]], block_size: int) -> Iterator[Block]:
    """Concatenate documents (each already ending in EOS) into overlapping blocks;
    the tokens left over at the end, too few for a block, are dropped."""
    tokens: list[int] = []
    doc_ids: list[int] = []
    for number, document in enumerate(documents):
        tokens.extend(document)
        doc_ids.extend([number] * len(document))
        while len(tokens) > block_size:
            first_doc = doc_ids[0]
            yield Block(tokens[: block_size + 1], [d - first_doc for d in doc_ids[: block_size + 1]])
            del tokens[:block_size], doc_ids[:block_size]


def block_tensors(block: Block, token_bytes: np.ndarray) -> Tensors:
    """The tensors of one block, as the objectives receive them (after batching)."""
    tokens = np.asarray(block.tokens, dtype=np.int64)
    return {
        "tokens": torch.from_numpy(tokens),
        "doc_ids": torch.tensor(block.doc_ids, dtype=torch.int64),
        # UTF-8 bytes behind the next-token targets: the denominator of bits per byte.
        "target_bytes": torch.tensor(int(token_bytes[tokens[1:]].sum())),
    }


class PackedBlocks:
    """Documents tokenised, separated by EOS and packed into `block_size + 1`-token blocks."""

    fields = TEXT_FIELDS
    kind: ClassVar[str] = "blocks"

    def __init__(self, tokenizer: Tokenizer, block_size: int) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size
        self.lengths = {"block_size": block_size}

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Block]:
        return pack_blocks((encode_document(self.tokenizer, text) for (text,) in samples), self.block_size)

    def tensors(self, example: Block) -> Tensors:
        return block_tensors(example, self.tokenizer.token_bytes)


# --- (query, passage) pairs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """The token ids of a query and its passage, each starting with CLS and truncated to its length."""

    query: list[int]
    passage: list[int]


def padded(ids: list[int], length: int) -> torch.Tensor:
    return torch.tensor(ids + [PAD_ID] * (length - len(ids)), dtype=torch.int64)


class TokenizedPairs:
    """(query, passage) text pairs, each side tokenised, CLS-prefixed, truncated and padded
    to its own fixed length (PAD marks the padding, so the towers can mask it)."""

    fields = PAIR_FIELDS
    kind: ClassVar[str] = "pairs"

    def __init__(self, tokenizer: Tokenizer, query_len: int, passage_len: int) -> None:
        self.tokenizer, self.query_len, self.passage_len = tokenizer, query_len, passage_len
        self.lengths = {"query_len": query_len, "passage_len": passage_len}

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Pair]:
        for query, passage in samples:
            yield Pair(self._ids(query, self.query_len), self._ids(passage, self.passage_len))

    def _ids(self, text: str, length: int) -> list[int]:
        return [CLS_ID, *self.tokenizer.encode(text)[: length - 1]]

    def tensors(self, example: Pair) -> Tensors:
        return {"query": padded(example.query, self.query_len), "passage": padded(example.passage, self.passage_len)}


# --- the stream ---------------------------------------------------------------------------------------


class ShardStream(IterableDataset):
    """An infinite stream of training examples for one rank (see module doc)."""

    def __init__(
        self,
        urls: Sequence[str],
        format: ExampleFormat[Any],
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 4096,
        cursors: Sequence[Cursor] | None = None,
        first_worker: int = 0,
    ) -> None:
        self.urls, self.format = list(urls), format
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer, self.cursors, self.first_worker = shuffle_buffer, cursors, first_worker
        self.skips = SkipCounter()

    def __iter__(self) -> Iterator[Tensors]:
        info = get_worker_info()
        loader_worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # A DataLoader takes batches from its workers in turn, starting with its worker 0. A restarted
        # loader must start with the worker whose turn was next, so its workers play rotated roles.
        worker = (loader_worker + self.first_worker) % workers
        if self.cursors is not None and len(self.cursors) != workers:
            raise ValueError(f"{len(self.cursors)} stream cursors for {workers} DataLoader workers")
        cursor = self.cursors[worker] if self.cursors is not None else Cursor()
        global_worker, global_workers = self.rank * workers + worker, self.world_size * workers
        for following, sample_id, example in self.examples(global_worker, global_workers, cursor):
            yield self.format.tensors(example) | {
                "sample_id": torch.tensor(sample_id),
                "skipped": torch.tensor(self.skips.take()),
                "worker": torch.tensor(worker),
                "cursor": torch.tensor([following.shard, following.block]),
            }

    def examples(self, global_worker: int, global_workers: int, start: Cursor) -> Iterator[tuple[Cursor, int, Any]]:
        """This worker's examples from `start` on, each with the cursor that follows it and its sample id."""
        empty: set[int] = set()  # shards without a whole example (the same in every epoch)
        for ordinal in itertools.count(start.shard):
            if len(empty) == len(self.urls):
                raise ValueError(
                    "no shard yields a whole example (too few tokens for a block, or no usable samples); "
                    "lower data.block_size or check the shards"
                )
            epoch, shard = worker_shard(ordinal, global_worker, global_workers, len(self.urls), self.seed)
            samples = self.skips.decoded([self.urls[shard]], self.format.fields)
            rng = seeded_rng(self.seed, epoch, shard)
            examples = buffer_shuffled(self.format.examples(samples), self.shuffle_buffer, rng)
            first = start.block if ordinal == start.shard else 0
            if first:
                collections.deque(itertools.islice(examples, first), maxlen=0)  # consumed before the cursor
                self.skips.take()  # and so were the skips they carried
            had_example = first > 0
            for index, example in enumerate(examples, start=first + 1):
                had_example = True
                yield Cursor(ordinal, index), stable_hash("sample", epoch, shard, index), example
            if not had_example:
                empty.add(shard)


def validation_examples(urls: Sequence[str], format: ExampleFormat, max_examples: int) -> list[Tensors]:
    """The first `max_examples` examples of the validation shards, read in manifest order as one
    stream, each with its position as `sample_id`."""
    examples = format.examples(SkipCounter().decoded(urls, format.fields))
    return [
        format.tensors(example) | {"sample_id": torch.tensor(index)}
        for index, example in enumerate(itertools.islice(examples, max_examples))
    ]
