"""The shard stream: shards -> tokens -> packed blocks -> shuffled blocks.

Every global worker (rank x DataLoader worker) reads an infinite, fixed
sequence of shards: the per-epoch shard permutations (seeded by `seed` and the
epoch, the same on every rank) are concatenated and dealt round-robin to the
global workers. No worker ever runs dry, the epoch is only a counter, and the
k-th shard of a worker is a pure function of (seed, k, worker, world size,
workers).

Inside a shard, documents are tokenised and packed into blocks, and the blocks
go through a shuffle buffer seeded by (seed, epoch, shard) that starts afresh
at every shard (the partial block left at the end of a shard is dropped). So
the blocks of a shard, and their order, are a pure function of the shard, and
a batch mixes many documents instead of holding consecutive pieces of one.

Each block carries the `Cursor` where its worker's stream continues. A
consumer that records the cursor of every block it trains on can restart the
stream exactly there: whole shards are skipped by arithmetic and only the
current shard is read again.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from pretraining.data.tokenizer import EOS_ID, Tokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class Cursor:
    """Where a worker's stream continues: after `block` blocks of its `shard`-th shard."""

    shard: int = 0
    block: int = 0


@dataclass(frozen=True)
class Block:
    """`block_size + 1` tokens (one extra so next-token targets stay inside the
    block; consecutive blocks of a document stream share that token, so no
    transition is lost) and the index of each token's document within the block."""

    tokens: list[int]
    doc_ids: list[int]


def seeded_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded by a stable hash of `parts` (stable across runs and Pythons)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


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


def encode_sample(tokenizer: Tokenizer, sample: dict[str, Any]) -> list[int]:
    """A document's tokens followed by the EOS separator."""
    return [*tokenizer.encode(sample["txt"].decode("utf-8")), EOS_ID]


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


def block_sample(
    block: Block, token_bytes: np.ndarray, cursor: Cursor = Cursor(), worker: int = 0
) -> dict[str, torch.Tensor]:
    """The tensors of one block, as the objectives receive them (after batching)."""
    tokens = np.asarray(block.tokens, dtype=np.int64)
    return {
        "tokens": torch.from_numpy(tokens),
        "doc_ids": torch.tensor(block.doc_ids, dtype=torch.int64),
        # UTF-8 bytes behind the next-token targets: the denominator of bits per byte.
        "target_bytes": torch.tensor(int(token_bytes[tokens[1:]].sum())),
        "worker": torch.tensor(worker),
        "cursor": torch.tensor([cursor.shard, cursor.block]),
    }


class ShardStream(IterableDataset):
    """An infinite stream of packed training blocks for one rank (see module doc)."""

    def __init__(
        self,
        urls: Sequence[str],
        tokenizer: Tokenizer,
        block_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 4096,
        cursors: Sequence[Cursor] | None = None,
    ) -> None:
        self.urls, self.tokenizer, self.block_size = list(urls), tokenizer, block_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer, self.cursors = shuffle_buffer, cursors

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if self.cursors is not None and len(self.cursors) != workers:
            raise ValueError(f"{len(self.cursors)} stream cursors for {workers} DataLoader workers")
        cursor = self.cursors[worker] if self.cursors is not None else Cursor()
        global_worker, global_workers = self.rank * workers + worker, self.world_size * workers
        for following, block in self.blocks(global_worker, global_workers, cursor):
            yield block_sample(block, self.tokenizer.token_bytes, following, worker)

    def blocks(self, global_worker: int, global_workers: int, start: Cursor) -> Iterator[tuple[Cursor, Block]]:
        """This worker's blocks from `start` on, each with the cursor that follows it."""
        empty: set[int] = set()  # shards without a whole block (the same in every epoch)
        for ordinal in itertools.count(start.shard):
            if len(empty) == len(self.urls):
                raise ValueError(f"no shard holds a whole block of {self.block_size + 1} tokens; lower data.block_size")
            epoch, shard = worker_shard(ordinal, global_worker, global_workers, len(self.urls), self.seed)
            documents = (encode_sample(self.tokenizer, sample) for sample in read_shard(self.urls[shard]))
            rng = seeded_rng(self.seed, epoch, shard)
            blocks = buffer_shuffled(pack_blocks(documents, self.block_size), self.shuffle_buffer, rng)
            first = start.block if ordinal == start.shard else 0
            had_block = first > 0
            for index, block in enumerate(itertools.islice(blocks, first, None), start=first + 1):
                had_block = True
                yield Cursor(ordinal, index), block
            if not had_block:
                empty.add(shard)


def validation_blocks(urls: Sequence[str], tokenizer: Tokenizer, block_size: int, max_blocks: int) -> list[dict]:
    """The first `max_blocks` blocks of the validation shards, read in manifest order."""
    documents = (encode_sample(tokenizer, sample) for url in urls for sample in read_shard(url))
    blocks = itertools.islice(pack_blocks(documents, block_size), max_blocks)
    return [block_sample(block, tokenizer.token_bytes) for block in blocks]
