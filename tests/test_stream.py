"""Packing, the resumable shard stream, validation blocks and the DataModule."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import random
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory

from conftest import packed_blocks, tokenized_pairs
from pretraining.data.batches import BatchPlan, BatchStream, batch_plan, default_streams
from pretraining.data.corpus import read_source
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import (
    Block,
    PackedBlocks,
    block_tensors,
    encode_document,
    middle_lines,
    pack_blocks,
    shares,
)
from pretraining.data.loader import (
    BATCHES_PER_MESSAGE,
    IN_THE_PIPE_BELOW,
    Message,
    OneBuffer,
    StreamEnded,
    dealt,
    in_one_buffer,
    per_message,
    training_loader,
)
from pretraining.data.manifest import Manifest
from pretraining.data.reader import read_shard
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.stream import Cursor, ShardStream, buffer_shuffled, seeded_rng, shard_order, stream_shard
from pretraining.data.tokenizer import EOS_ID, BPETokenizer, ByteTokenizer, train_bpe
from pretraining.data.validation import ValidationSet, shared_alike, spread, validation_examples
from pretraining.errors import ShardError
from pretraining.instantiate import build

BLOCK = 32
SEED = 7
BUFFER = 4
WINDOW = 40  # blocks compared after a resume: more than any shard holds, so the next shard is read too
WORDS = ["def", "return", "self", "import", "value", "café", "日本語", "🙂", "x", "(", ")", ":"]


# --- a small shard directory: few, small shards so the stream wraps epochs quickly ---------------------


def write_corpus(root: Path, documents: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(documents):
        lines = [f"document {number}"]
        lines += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(rng.randint(1, 8))]
        (root / f"doc_{number:03d}.txt").write_text("\n".join(lines), encoding="utf-8")
    (root / "copy_of_doc_000.txt").write_bytes((root / "doc_000.txt").read_bytes())
    (root / "empty.txt").write_bytes(b"")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    return root


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("stream")
    corpus = write_corpus(base / "corpus", documents=30)
    out = base / "shards"
    settings = BuildSettings(validation_fraction=0.25, max_shard_samples=5, max_shard_bytes=1_000_000)
    build_shards(read_source(str(corpus)), out, [str(corpus)], settings, show_progress=False)
    return out


@pytest.fixture(scope="module")
def train_urls(shard_dir) -> list[str]:
    urls = Manifest.load(shard_dir).urls("train")
    assert len(urls) >= 6
    return urls


@functools.cache
def shard_documents(url: str) -> tuple[tuple[int, ...], ...]:
    """A shard's documents (tokens with EOS) in shard order, read straight from the tar."""
    tokenizer = ByteTokenizer()
    return tuple(tuple(encode_document(tokenizer, sample["txt"].decode())) for sample in read_shard(url))


def shard_size(url: str) -> int:
    return sum(map(len, shard_documents(url)))


def packed(url: str, block_size: int = BLOCK) -> list[Block]:
    """A shard's blocks, packed in shard order and not shuffled."""
    return list(pack_blocks((list(document) for document in shard_documents(url)), block_size))


def shuffled(urls, shard: int, epoch: int, seed: int = SEED, buffer: int = BUFFER, block_size: int = BLOCK):
    """A shard's blocks in the order the stream must give them in `epoch`, built by hand."""
    documents = (list(document) for document in shard_documents(urls[shard]))
    rng = seeded_rng(seed, epoch, shard)
    return list(buffer_shuffled(pack_blocks(documents, block_size), buffer, rng))


def blocks(dataset: ShardStream, worker: int, workers: int, start: Cursor) -> Iterator[tuple[Cursor, Block]]:
    """The stream's (cursor, block)s for a global worker, without the sample ids."""
    return ((item.cursor, item.example) for item in dataset.examples(worker, workers, start))


def validation_blocks(urls, tokenizer, block_size: int, max_blocks: int) -> list[dict[str, torch.Tensor]]:
    return validation_set(urls, tokenizer, block_size, max_blocks).examples


def validation_set(urls, tokenizer, block_size: int, max_blocks: int) -> ValidationSet:
    documents = sum(len(shard_documents(url)) for url in urls)
    return validation_examples(urls, PackedBlocks(tokenizer, block_size), max_blocks, documents)


def take(dataset, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(dataset), count))


def take_examples(dataset: ShardStream, count: int, start: Cursor | None = None) -> list[dict[str, torch.Tensor]]:
    """The first `count` examples of stream 0 of 1 from `start`, as tensors with their cursor and sample id."""
    examples = itertools.islice(dataset.examples(0, 1, start or Cursor()), count)
    return [
        dataset.format.tensors(item.example)
        | {"cursor": torch.tensor([item.cursor.shard, item.cursor.block]), "sample_id": torch.tensor(item.sample_id)}
        for item in examples
    ]


def plain(sample: dict[str, torch.Tensor]) -> tuple:
    return (
        sample["tokens"].tolist(),
        sample["doc_ids"].tolist(),
        sample["cursor"].tolist(),
        int(sample["target_bytes"]),
    )


def pair(block: Block) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(block.tokens), tuple(block.doc_ids)


def cursor_of(sample: dict[str, torch.Tensor]) -> Cursor:
    return Cursor(*sample["cursor"].tolist())


def unpack(token_lists: list[list[int]]) -> list[int]:
    """The token stream behind overlapping blocks: the first block whole, then each without its first token."""
    stream = list(token_lists[0])
    for tokens in token_lists[1:]:
        assert stream[-1] == tokens[0]
        stream.extend(tokens[1:])
    return stream


# --- pack_blocks on hand-made documents ----------------------------------------------------------------


def handmade_documents(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 1, 17, 8, 60, 2, 9, 31, 32, 33, 5, 1, 1, 70, 4, 12, 16, 0, 7, 24]
    return [[rng.randrange(4, 260) for _ in range(length)] + [EOS_ID] for length in lengths]


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 32])
def test_pack_blocks_loses_and_duplicates_nothing(block_size):
    documents = handmade_documents()
    stream = [token for tokens in documents for token in tokens]
    blocks = list(pack_blocks(iter(documents), block_size))
    # Only the tail, too short for another block, is dropped.
    assert len(blocks) == (len(stream) - 1) // block_size
    for block in blocks:
        assert len(block.tokens) == len(block.doc_ids) == block_size + 1
    for before, after in itertools.pairwise(blocks):
        assert before.tokens[-1] == after.tokens[0]  # the overlap of one token
    assert unpack([b.tokens for b in blocks]) == stream[: 1 + len(blocks) * block_size]


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 32])
def test_pack_blocks_doc_ids(block_size):
    documents = handmade_documents()
    document_of_token = [number for number, tokens in enumerate(documents) for _ in tokens]
    for index, block in enumerate(pack_blocks(iter(documents), block_size)):
        assert block.doc_ids[0] == 0
        # A new document starts exactly after each EOS.
        for j in range(1, len(block.tokens)):
            assert block.doc_ids[j] == block.doc_ids[j - 1] + (block.tokens[j - 1] == EOS_ID)
        first = document_of_token[index * block_size]
        absolute = document_of_token[index * block_size : index * block_size + block_size + 1]
        assert block.doc_ids == [d - first for d in absolute]


def test_pack_blocks_separates_documents_with_eos():
    documents = [[10, 11], [12], [13, 14, 15]]
    (block,) = pack_blocks(iter([[*d, EOS_ID] for d in documents]), 8)
    assert block.tokens == [10, 11, EOS_ID, 12, EOS_ID, 13, 14, 15, EOS_ID]
    assert block.doc_ids == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_pack_blocks_short_input_and_tail():
    assert list(pack_blocks(iter([[5, 6, EOS_ID]]), 3)) == []
    (block,) = pack_blocks(iter([[5, 6, EOS_ID], [EOS_ID]]), 3)
    assert block == Block([5, 6, EOS_ID, EOS_ID], [0, 0, 0, 1])
    # The 3 tokens left after that block ([EOS, 7, EOS]) are one short of another block: dropped.
    assert list(pack_blocks(iter([[5, 6, EOS_ID], [EOS_ID], [7, EOS_ID]]), 3)) == [block]
    assert len(list(pack_blocks(iter([[5, 6, EOS_ID], [EOS_ID], [7, 8, EOS_ID]]), 3))) == 2


def test_pack_blocks_is_lazy():
    pulled = []

    def documents():
        for number in itertools.count():
            pulled.append(number)
            yield [4 + number % 200] * 9 + [EOS_ID]

    blocks = list(itertools.islice(pack_blocks(documents(), 16), 3))
    assert len(blocks) == 3 and len(pulled) <= 5  # 49 tokens needed, 10 per document


def test_encode_document_appends_eos():
    tokenizer = ByteTokenizer()
    assert encode_document(tokenizer, "é!") == [*tokenizer.encode("é!"), EOS_ID]


def test_block_tensors():
    tokenizer = ByteTokenizer()
    (block,) = pack_blocks(iter([[*tokenizer.encode("abc"), EOS_ID], tokenizer.encode("d")]), 4)
    sample = block_tensors(block, tokenizer.token_bytes)
    assert sample["tokens"].dtype == torch.int64 and sample["tokens"].tolist() == block.tokens
    assert sample["doc_ids"].dtype == torch.int64 and sample["doc_ids"].tolist() == [0, 0, 0, 0, 1]
    assert int(sample["target_bytes"]) == 3  # b, c, d: the first token is no target and EOS has no bytes
    weights = np.arange(300, dtype=np.int64)
    assert int(block_tensors(block, weights)["target_bytes"]) == sum(block.tokens[1:])


# --- shuffling helpers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_size", [1, 7, 50, 500])
def test_buffer_shuffled_is_a_seeded_permutation(buffer_size):
    items = list(range(50))
    first = list(buffer_shuffled(iter(items), buffer_size, seeded_rng("test", 1)))
    assert sorted(first) == items
    assert list(buffer_shuffled(iter(items), buffer_size, seeded_rng("test", 1))) == first
    if buffer_size == 1:
        assert first == items
    else:
        assert first != items
        assert list(buffer_shuffled(iter(items), buffer_size, seeded_rng("test", 2))) != first


def test_seeded_rng_is_a_function_of_its_parts():
    assert seeded_rng(1, "a").random() == seeded_rng(1, "a").random()
    assert seeded_rng(1, "a").random() != seeded_rng(1, "b").random()


def test_worker_shard_deals_epoch_permutations_round_robin():
    for num_shards, workers in [(4, 1), (4, 2), (5, 2), (3, 4), (6, 3)]:
        orders = [shard_order(num_shards, SEED, epoch) for epoch in range(4)]
        for order in orders:
            assert sorted(order) == list(range(num_shards))
        positions = range(3 * num_shards)
        for position in positions:
            worker, ordinal = position % workers, position // workers
            epoch = position // num_shards
            assert stream_shard(ordinal, worker, workers, num_shards, SEED) == (
                epoch,
                orders[epoch][position % num_shards],
            )
    assert len({tuple(shard_order(8, SEED, epoch)) for epoch in range(5)}) > 1
    assert shard_order(8, SEED, 0) != shard_order(8, SEED + 1, 0)


# --- ShardStream ---------------------------------------------------------------------------------------


def stream(urls, seed=SEED, block_size=BLOCK, **kwargs) -> ShardStream:
    kwargs.setdefault("shuffle_buffer", BUFFER)
    return ShardStream(urls, PackedBlocks(ByteTokenizer(), block_size), seed, **kwargs)


def epoch_of(cursor: Cursor, urls, worker: int = 0, workers: int = 1) -> int:
    return stream_shard(cursor.shard, worker, workers, len(urls), SEED)[0]


def worker_blocks(
    dataset: ShardStream, worker: int, workers: int, epochs: int
) -> dict[tuple[int, int], list[tuple[Cursor, Block]]]:
    """(epoch, shard) -> the (cursor, block)s a global worker reads from it, for its first `epochs` epochs."""
    seen: dict[tuple[int, int], list[tuple[Cursor, Block]]] = defaultdict(list)
    for cursor, block in blocks(dataset, worker, workers, Cursor()):
        epoch, shard = stream_shard(cursor.shard, worker, workers, len(dataset.urls), dataset.seed)
        if epoch >= epochs:
            return dict(seen)
        seen[(epoch, shard)].append((cursor, block))
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def reference(train_urls) -> list[dict[str, torch.Tensor]]:
    return take_examples(stream(train_urls), 420)


def test_default_shuffle_buffer():
    assert ShardStream(["unused"], PackedBlocks(ByteTokenizer(), BLOCK), SEED).shuffle_buffer == 4096


def test_stream_blocks_are_well_formed(reference, train_urls):
    tokenizer = ByteTokenizer()
    for sample in reference:
        assert sample["tokens"].shape == sample["doc_ids"].shape == (BLOCK + 1,)
        assert sample["tokens"].dtype == sample["doc_ids"].dtype == torch.int64
        assert sample["cursor"].shape == (2,)
        assert int(sample["doc_ids"][0]) == 0
        assert int(sample["target_bytes"]) == int(tokenizer.token_bytes[sample["tokens"][1:].numpy()].sum())
    # The samples are `blocks` of global worker 0 of 1, each with the cursor that follows it.
    expected = itertools.islice(stream(train_urls).examples(0, 1, Cursor()), len(reference))
    assert [(s["tokens"].tolist(), s["doc_ids"].tolist(), cursor_of(s), int(s["sample_id"])) for s in reference] == [
        (item.example.tokens, item.example.doc_ids, item.cursor, item.sample_id) for item in expected
    ]
    for url in train_urls:
        for document in shard_documents(url):
            assert document[-1] == EOS_ID and EOS_ID not in document[:-1]


def test_stream_cursors_count_the_blocks_of_each_shard(reference, train_urls):
    cursors = [cursor_of(s) for s in reference]
    assert cursors[0] == Cursor(0, 1)
    for before, after in itertools.pairwise(cursors):
        if after.shard == before.shard:
            assert after.block == before.block + 1
        else:
            # Every shard here holds blocks, so none is skipped; the last block of a shard says so.
            assert after == Cursor(before.shard + 1, 1)
            shard = stream_shard(before.shard, 0, 1, len(train_urls), SEED)[1]
            assert before.block == len(packed(train_urls[shard]))


@pytest.mark.parametrize("buffer", [1, BUFFER, 4096])
def test_each_shard_gives_its_shuffled_packing(train_urls, buffer):
    """Each (epoch, shard) gives its documents packed, then shuffled with the rng of (seed, epoch, shard)."""
    seen = worker_blocks(stream(train_urls, shuffle_buffer=buffer), 0, 1, epochs=2)
    assert set(seen) == {(epoch, shard) for epoch in (0, 1) for shard in range(len(train_urls))}
    for (epoch, shard), items in seen.items():
        expected = shuffled(train_urls, shard, epoch, buffer=buffer)
        assert [pair(block) for _, block in items] == [pair(block) for block in expected], (epoch, shard)
        ordinal = items[0][0].shard
        assert [cursor for cursor, _ in items] == [Cursor(ordinal, k) for k in range(1, len(expected) + 1)]


def test_each_shard_is_packed_afresh_and_its_tail_dropped(train_urls):
    """Without the shuffle, the blocks of a shard are its documents laid end to end, from its first token."""
    in_order = worker_blocks(stream(train_urls, shuffle_buffer=1), 0, 1, epochs=2)
    buffered = worker_blocks(stream(train_urls), 0, 1, epochs=2)
    assert set(in_order) == set(buffered)
    reordered = 0
    for key, items in in_order.items():
        flat = [token for document in shard_documents(train_urls[key[1]]) for token in document]
        tokens = [block.tokens for _, block in items]
        assert len(tokens) == (len(flat) - 1) // BLOCK
        assert unpack(tokens) == flat[: 1 + len(tokens) * BLOCK]
        # The shuffle buffer reorders the same blocks.
        mine = [pair(block) for _, block in items]
        theirs = [pair(block) for _, block in buffered[key]]
        assert sorted(mine) == sorted(theirs)
        reordered += mine != theirs
    assert reordered == len(in_order)


@pytest.mark.parametrize("buffer", [BUFFER, 4096])
def test_block_order_in_a_shard_depends_on_seed_and_epoch(train_urls, buffer):
    seen = worker_blocks(stream(train_urls, shuffle_buffer=buffer), 0, 1, epochs=2)
    other = worker_blocks(stream(train_urls, seed=SEED + 1, shuffle_buffer=buffer), 0, 1, epochs=1)

    def order(items: list[tuple[Cursor, Block]]) -> list[tuple[int, ...]]:
        return [tuple(block.tokens) for _, block in items]

    shards = range(len(train_urls))
    for shard in shards:
        assert sorted(order(seen[(0, shard)])) == sorted(order(seen[(1, shard)])) == sorted(order(other[(0, shard)]))
    # A small buffer only moves blocks locally; a full one reorders every shard (each holds > 10 blocks).
    check = all if buffer > 100 else any
    assert check(order(seen[(0, shard)]) != order(seen[(1, shard)]) for shard in shards)
    assert check(order(seen[(0, shard)]) != order(other[(0, shard)]) for shard in shards)
    assert worker_blocks(stream(train_urls, shuffle_buffer=buffer), 0, 1, epochs=2) == seen


def test_stream_wraps_epochs(reference, train_urls):
    cursors = [cursor_of(s) for s in reference]
    epochs = [epoch_of(c, train_urls) for c in cursors]
    assert epochs == sorted(epochs)
    assert epochs[-1] >= 4
    # Every complete epoch holds every block of every shard exactly once.
    everything = sorted(tuple(block.tokens) for url in train_urls for block in packed(url))
    for epoch in range(epochs[-1]):
        mine = sorted(tuple(s["tokens"].tolist()) for s, e in zip(reference, epochs, strict=True) if e == epoch)
        assert mine == everything, epoch


def test_stream_is_deterministic_and_seeded(reference, train_urls):
    assert [plain(s) for s in take_examples(stream(train_urls), len(reference))] == [plain(s) for s in reference]
    other = take_examples(stream(train_urls, seed=SEED + 1), 60)
    assert [plain(s)[0] for s in other] != [plain(s)[0] for s in reference[:60]]


def test_stream_resumes_exactly_from_any_cursor(reference, train_urls):
    cursors = [cursor_of(s) for s in reference]
    epochs = [epoch_of(c, train_urls) for c in cursors]
    # The last block of each shard: its cursor is the shard's end (block == the shard's number of blocks).
    ends = [k for k in range(len(cursors) - 1) if cursors[k + 1].shard != cursors[k].shard]
    epoch_ends = [k for k in ends if epochs[k + 1] != epochs[k]]
    assert len(ends) >= 15 and len(epoch_ends) >= 3
    ks = {0, 1, 2, len(reference) // 2, len(reference) - 2, *ends}
    for k in ends[:3] + epoch_ends:
        ks |= {k - 1, k + 1, k + 2}
    for k in sorted(ks):
        expected = [plain(s) for s in reference[k + 1 : k + 1 + WINDOW]]
        again = take_examples(stream(train_urls), len(expected), cursors[k])
        assert [plain(s) for s in again] == expected, (k, cursors[k])
    # The end of a shard and the start of the next are the same place.
    for k in ends[:3] + epoch_ends:
        expected = [plain(s) for s in reference[k + 1 : k + 1 + WINDOW]]
        again = take_examples(stream(train_urls), len(expected), Cursor(cursors[k].shard + 1, 0))
        assert [plain(s) for s in again] == expected, k


def test_stream_resumes_at_the_end_of_its_only_shard(train_urls):
    urls = train_urls[:1]
    count = len(packed(urls[0]))
    reference = take_examples(stream(urls), 3 * count)
    assert cursor_of(reference[count - 1]) == Cursor(0, count)
    again = take_examples(stream(urls), 2 * count, Cursor(0, count))
    assert [plain(s) for s in again] == [plain(s) for s in reference[count:]]


@pytest.mark.parametrize(("num_shards", "workers"), [(4, 1), (3, 2), (4, 2), (5, 3), (6, 4), (2, 3)])
def test_workers_read_disjoint_shards_covering_each_epoch(train_urls, num_shards, workers):
    urls = train_urls[:num_shards]
    dataset = stream(urls)
    seen = [worker_blocks(dataset, worker, workers, epochs=2) for worker in range(workers)]
    for epoch in (0, 1):
        shards = [shard for mine in seen for (e, shard) in mine if e == epoch]
        assert sorted(shards) == list(range(num_shards))  # disjoint, and together all of them
    for mine in seen:
        for (epoch, shard), items in mine.items():
            assert [pair(block) for _, block in items] == [pair(block) for block in shuffled(urls, shard, epoch)]


def test_workers_resume_exactly(train_urls):
    dataset = stream(train_urls[:5])
    for worker in range(3):
        reference = list(itertools.islice(blocks(dataset, worker, 3, Cursor()), 60))
        ends = [k for k in range(len(reference) - 1) if reference[k + 1][0].shard != reference[k][0].shard]
        for k in [0, 7, *ends]:
            again = itertools.islice(blocks(dataset, worker, 3, reference[k][0]), len(reference) - k - 1)
            assert list(again) == reference[k + 1 :], (worker, k)


# --- the global batch: BatchPlan and BatchStream -------------------------------------------------------


@pytest.mark.parametrize(
    ("global_batch", "micro", "streams", "devices", "message"),
    [
        (8, None, 4, 3, r"data\.global_batch_size=8 is not divisible by the 3 devices"),
        (8, 3, 4, 2, r"4 per device, not a multiple of data\.micro_batch_size=3"),
        (8, 2, 3, 1, r"data\.streams=3 does not divide data\.global_batch_size=8"),
        (8, None, 2, 4, r"data\.streams=2 is not a multiple of the 4 devices"),
        (8, 1, 4, 1, r"data\.micro_batch_size=1 must be a multiple of the 2 examples each"),
    ],
)
def test_batch_plan_refuses_what_devices_cannot_share(global_batch, micro, streams, devices, message):
    with pytest.raises(ValueError, match=message):
        batch_plan(global_batch, micro, streams, devices)


def test_batch_plan_derives_the_accumulation():
    assert batch_plan(16, None, 4, 2) == BatchPlan(16, 8, 4, 2)
    assert batch_plan(16, 2, 8, 2).accumulation == 4 and batch_plan(16, 8, 4, 1).accumulation == 2
    plan = batch_plan(16, 4, 8, 2)  # chunks of 2: each micro-batch is two streams' chunks
    assert [plan.slot_of(1, index) for index in range(3)] == [(0, 2), (0, 3), (1, 2)]
    assert list(plan.streams_of(3)) == [6, 7]


def micro_batches(plan: BatchPlan, rank: int, urls, count: int, workers: int = 0, **state) -> list:
    """The first `count` micro-batches of a rank, through a DataLoader with `workers` workers."""
    stream = BatchStream([ShardStream(urls, PackedBlocks(ByteTokenizer(), BLOCK), SEED, BUFFER)], plan, rank, **state)
    return take(training_loader(stream, workers, pin_memory=False), count)


def global_batches(plan: BatchPlan, urls, steps: int, workers: int = 0) -> list[list[int]]:
    """Each step's sample ids over all devices, in slot order."""
    ranks = [micro_batches(plan, rank, urls, steps * plan.accumulation, workers) for rank in range(plan.world_size)]
    return [
        [
            int(i)
            for rank in ranks
            for batch in rank[step * plan.accumulation : (step + 1) * plan.accumulation]
            for i in batch["sample_id"]
        ]
        for step in range(steps)
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_layout_of_devices_and_micro_batches_trains_on_the_same_batches(train_urls, workers):
    """The examples of each step depend on the global batch and the streams, not on how devices share it."""
    layouts = [(None, 1), (2, 1), (4, 1), (2, 2), (None, 2), (2, 4), (None, 4)]  # (micro-batch, devices)
    steps = [global_batches(batch_plan(8, micro, 4, devices), train_urls, 5, workers) for micro, devices in layouts]
    assert all(len(step) == len(set(step)) == 8 for step in steps[0])  # no example twice in a step
    assert all(other == steps[0] for other in steps[1:])
    # Each device reads its own examples: the ranks' samples are disjoint.
    plan = batch_plan(8, 2, 4, 2)
    ranks = [
        {int(i) for b in micro_batches(plan, rank, train_urls, 10, workers) for i in b["sample_id"]} for rank in (0, 1)
    ]
    assert ranks[0].isdisjoint(ranks[1]) and len(ranks[0]) == len(ranks[1]) == 20


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_stream_resumes_exactly_on_any_number_of_devices(train_urls, workers):
    reference = global_batches(batch_plan(8, 2, 4, 1), train_urls, 9, workers)
    # Two devices run 4 steps and save their cursors (as the DataModule does, from each consumed batch).
    plan = batch_plan(8, 2, 4, 2)
    cursors = {}
    for rank in (0, 1):
        for batch in micro_batches(plan, rank, train_urls, 4 * plan.accumulation, workers):
            cursors |= {
                (source, sub): Cursor(shard, block) for source, sub, shard, block in batch["positions"].tolist()
            }
    # One device, or four, continues from them at step 4 exactly where the uninterrupted run went.
    for continued in (batch_plan(8, 2, 4, 1), batch_plan(8, None, 4, 4)):
        ranks = [
            micro_batches(
                continued,
                rank,
                train_urls,
                5 * continued.accumulation,
                workers,
                cursors=cursors,
                start=4 * continued.accumulation,
            )
            for rank in range(continued.world_size)
        ]
        per_step = continued.accumulation
        again = [
            [int(i) for rank in ranks for batch in rank[s * per_step : (s + 1) * per_step] for i in batch["sample_id"]]
            for s in range(5)
        ]
        assert again == reference[4:]


def test_a_message_of_batches_crosses_from_a_worker_in_one_buffer_and_arrives_whole() -> None:
    batch = {
        "tokens": torch.arange(24).view(4, 6)[:, ::2],  # not contiguous
        "flags": torch.tensor([True, False, True]),
        "scale": torch.tensor(2.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "name": "shard-0",
        "big": torch.arange(IN_THE_PIPE_BELOW // 8, dtype=torch.float64),
    }
    other = {"tokens": torch.ones(2, 5, dtype=torch.int16), "name": None}
    for keys, shared in ((["tokens", "flags", "scale", "empty", "name"], False), (list(batch), True)):
        message = [{key: batch[key] for key in keys}, other]
        sent = in_one_buffer(message)
        # What a worker's queue does: a small buffer crosses by value, a large one in shared memory.
        arrived = ForkingPickler.loads(ForkingPickler.dumps(sent))
        assert arrived.buffer.is_shared() == shared
        first, second = arrived.batches()
        assert list(first) == keys and first["name"] == "shard-0" and second["name"] is None
        for key in keys[:4] + keys[5:]:
            assert first[key].dtype == batch[key].dtype and torch.equal(first[key], batch[key])
        assert second["tokens"].dtype == torch.int16 and torch.equal(second["tokens"], other["tokens"])
    # Nested tensors and sparse ones cross as torch sends them.
    for unpackable in ({"nested": [torch.zeros(2)]}, {"sparse": torch.eye(2).to_sparse()}):
        assert in_one_buffer([other, unpackable]) == [other, unpackable]


class Numbered(torch.utils.data.IterableDataset):
    """Batches numbered in the order a consumer must receive them: worker w of n makes w, w + n, ... up to
    `end` (endless if None); the batch numbered `fail_at` raises instead. `big_worker`'s batches are too big
    to share a message."""

    def __init__(self, fail_at: int | None = None, end: int | None = None, big_worker: int | None = None) -> None:
        self.fail_at, self.end, self.big_worker = fail_at, end, big_worker

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        values = IN_THE_PIPE_BELOW // 4 if info.id == self.big_worker else 4
        for index in itertools.count(info.id, info.num_workers):
            if index == self.fail_at:
                raise ShardError(f"batch {index} is bad")
            if index == self.end:
                return
            yield {"index": torch.tensor(index), "values": torch.full((values,), float(index))}


def indices(batches) -> list[int]:
    return [int(batch["index"]) for batch in batches]


@pytest.mark.parametrize("workers", [1, 3])
def test_workers_send_batches_several_to_a_message_and_they_arrive_in_order(workers) -> None:
    count = 2 * 3 * BATCHES_PER_MESSAGE  # two messages from each of 3 workers, or six from one
    loader = training_loader(Numbered(), workers, pin_memory=False)
    received = take(loader, count)
    assert indices(received) == list(range(count))
    # A worker's consecutive batches came in one message, one buffer: they share its storage.
    assert len({batch["values"].untyped_storage().data_ptr() for batch in received}) == 6
    assert indices(take(loader, 5)) == list(range(5))  # iterated again, the persistent workers start again
    # Batches too big for the pipe come one to a message.
    big = take(training_loader(Numbered(big_worker=0), 1, pin_memory=False), 3)
    assert indices(big) == [0, 1, 2] and len({batch["values"].untyped_storage().data_ptr() for batch in big}) == 3


@pytest.mark.parametrize(
    ("fail_at", "big_worker"),
    [(0, None), (11, None), (16, None), (16, 1)],  # worker 1's messages hold one batch each, worker 0's eight
)
def test_a_workers_error_arrives_after_the_batches_made_before_it(fail_at, big_worker) -> None:
    loader = iter(training_loader(Numbered(fail_at, big_worker=big_worker), 2, pin_memory=False))
    assert indices(itertools.islice(loader, fail_at)) == list(range(fail_at))
    # Our message alone, as the worker raised it (torch's would hold the worker's traceback), which is a note.
    with pytest.raises(ShardError, match=rf"^batch {fail_at} is bad\nin DataLoader worker process [01]:\nTraceback"):
        next(loader)


def test_a_message_holds_as_many_batches_as_fit_in_the_pipe() -> None:
    for nbytes in (1, 1000, IN_THE_PIPE_BELOW // 8 - 32, IN_THE_PIPE_BELOW // 3, IN_THE_PIPE_BELOW):
        batch = {"tokens": torch.zeros(nbytes, dtype=torch.uint8), "positions": torch.zeros(1, 3, dtype=torch.int64)}
        count = per_message(batch)
        assert count == 1 or in_one_buffer([batch] * count).buffer.nbytes < IN_THE_PIPE_BELOW
        assert count == BATCHES_PER_MESSAGE or in_one_buffer([batch] * (count + 1)).buffer.nbytes >= IN_THE_PIPE_BELOW
    assert per_message({"nested": [torch.zeros(2)]}) == per_message((torch.zeros(2),)) == 1  # not in one buffer


def test_a_workers_error_leaves_no_reference_cycle_to_its_workers() -> None:
    """Dropping the loader stops its workers at once, not at a later garbage collection (which waits 5 s for
    each, since the finalizer that stops their queue runs first): torch's own `reraise` leaves such a cycle."""
    loader = training_loader(Numbered(fail_at=3), 2, pin_memory=False)
    batches = iter(loader)
    with contextlib.suppress(ShardError):
        list(batches)
    workers = weakref.ref(loader._iterator)  # the persistent workers' iterator (private to torch)
    gc.disable()
    try:
        del loader, batches
        assert workers() is None
    finally:
        gc.enable()


def test_the_batches_end_where_the_first_workers_stream_ends() -> None:
    # Worker 0 ends before batch 10; worker 1 would go on to 39. Later batches would leave a gap.
    assert indices(training_loader(Numbered(end=10, big_worker=1), 2, pin_memory=False)) == list(range(10))


def test_dealt_restores_the_order_the_workers_made_whatever_their_messages_hold_and_their_arrival() -> None:
    workers, made = 3, [itertools.count(worker, 3) for worker in range(3)]
    sizes = [[1, 4, 2, 5], [3, 3, 3, 3, 3], [2, 1, 8]]  # worker 2 ends first, after its 11th batch
    sent = [
        [
            Message(worker, [next(made[worker]) for _ in range(size)], StreamEnded() if number == len(counts) else None)
            for number, size in enumerate(counts, start=1)
        ]
        for worker, counts in enumerate(sizes)
    ]
    arrived, rng = [], random.Random(0)  # each worker's messages in order, the workers' in any order
    while any(sent):
        arrived.append(rng.choice([messages for messages in sent if messages]).pop(0))
    assert list(dealt(iter(arrived), workers)) == list(range(3 * 11 + 2))


def test_a_training_batch_arrives_in_one_buffer_and_is_pinned_whole(train_urls, monkeypatch) -> None:
    batch = micro_batches(batch_plan(8, None, 4, 1), 0, train_urls, 1, workers=1)[0]
    storages = {value.untyped_storage().data_ptr() for value in batch.values()}
    assert len(batch) >= 5 and len(storages) == 1
    # On a GPU the DataLoader's pinning thread pins what a worker sent: the buffer, whole.
    monkeypatch.setattr(torch.Tensor, "pin_memory", torch.Tensor.clone)  # no GPU here: a copy stands in
    sent = in_one_buffer([batch, batch])
    pinned = pin_memory(sent)
    assert isinstance(pinned, OneBuffer) and pinned.buffer.data_ptr() != sent.buffer.data_ptr()
    for arrived in pinned.batches():
        assert all(torch.equal(arrived[key], value) for key, value in batch.items())


# --- shards too small for a block ----------------------------------------------------------------------


def test_no_whole_block_raises(train_urls, shard_dir):
    biggest = max(map(shard_size, train_urls))
    dataset = stream(train_urls, block_size=biggest)  # a block needs biggest + 1 tokens
    with pytest.raises(ValueError, match=r"make the examples shorter \(data\.format\.block_size="):
        next(dataset.examples(0, 1, Cursor()))
    with pytest.raises(ValueError, match=r"make the examples shorter \(data\.format\.block_size="):
        next(blocks(dataset, 2, 3, Cursor(7, 0)))
    dm = ShardDataModule(
        str(shard_dir), ByteTokenizer(), format=packed_blocks(biggest), global_batch_size=2, num_workers=0
    )
    with pytest.raises(ValueError, match=r"make the examples shorter \(data\.format\.block_size="):
        next(iter(dm.train_dataloader()))
    # One token fewer, and the biggest shard holds exactly one block: all of it.
    (first,) = take_examples(stream(train_urls, block_size=biggest - 1), 1)
    (url,) = [url for url in train_urls if shard_size(url) == biggest]
    assert first["tokens"].tolist() == [token for document in shard_documents(url) for token in document]


def test_shards_without_a_whole_block_are_skipped(train_urls):
    sizes = sorted(map(shard_size, train_urls))
    block_size = sizes[2] - 1  # the two smallest shards hold no block, the third exactly one
    dataset = stream(train_urls, block_size=block_size)
    seen = worker_blocks(dataset, 0, 1, epochs=4)
    full = {shard for shard, url in enumerate(train_urls) if shard_size(url) > block_size}
    assert len(full) == len(train_urls) - 2
    assert set(seen) == {(epoch, shard) for epoch in range(4) for shard in full}
    for (epoch, shard), items in seen.items():
        expected = shuffled(train_urls, shard, epoch, block_size=block_size)
        assert [pair(block) for _, block in items] == [pair(block) for block in expected]
    for cursor, _ in itertools.islice(blocks(dataset, 0, 1, Cursor()), 30):
        assert stream_shard(cursor.shard, 0, 1, len(train_urls), SEED)[1] in full


def test_one_empty_shard_of_two_does_not_stop_the_stream(train_urls):
    small, big = sorted(train_urls, key=shard_size)[:: len(train_urls) - 1]
    urls = [small, big]
    block_size = shard_size(small)  # `small` holds no block, `big` does
    for worker, workers in [(0, 1), (0, 2), (1, 2)]:
        read = list(itertools.islice(blocks(stream(urls, block_size=block_size), worker, workers, Cursor()), 20))
        assert all(stream_shard(c.shard, worker, workers, 2, SEED)[1] == 1 for c, _ in read)


# --- validation blocks ---------------------------------------------------------------------------------


def test_validation_is_spread_over_the_split_and_the_same_text_for_any_tokenizer(train_urls, tmp_path):
    urls = train_urls  # any shards: these hold more documents
    texts = [sample["txt"].decode() for url in urls for sample in read_shard(url)]
    train_bpe(texts, vocab_size=320, out_path=tmp_path / "tokenizer.json")
    assert len(texts) > 6
    small = validation_set(urls, ByteTokenizer(), 16, max_blocks=3)  # 3 documents, 48 characters shared out
    assert small.documents == 3 and small.split_documents == len(texts)
    windows = [middle_lines(texts[index], 16) for index in sorted(spread(3, len(texts)))]
    assert spread(3, len(texts)) == {0, len(texts) // 3, 2 * len(texts) // 3}
    assert small.text_bytes == sum(len(window.encode()) for window in windows)
    flat = [token for window in windows for token in encode_document(ByteTokenizer(), window)]
    assert unpack([block["tokens"].tolist() for block in small.examples]) == flat[: 1 + 16 * len(small.examples)]

    whole = validation_set(urls, ByteTokenizer(), 16, max_blocks=10_000)  # every document, whole
    assert whole.documents == len(texts) and whole.text_bytes == sum(len(text.encode()) for text in texts)
    assert [int(block["sample_id"]) for block in whole.examples] == list(range(len(whole.examples)))
    bpe = validation_set(urls, BPETokenizer(tmp_path / "tokenizer.json"), 16, max_blocks=64)
    same = validation_set(urls, ByteTokenizer(), 16, max_blocks=64)
    assert bpe.text_bytes == same.text_bytes and bpe.documents == same.documents == len(texts)
    assert len(bpe.examples) < len(same.examples)  # the same text in fewer blocks
    scored = [sum(int(block["target_bytes"]) for block in chosen.examples) for chosen in (bpe, same)]
    assert abs(scored[0] - scored[1]) < 16 * 8  # all of it but the tail of a block (UTF-8 bytes per BPE token)


def test_the_validation_budget_counts_utf8_bytes_as_byte_tokens_do():
    documents = [("".join(f"行{number} 日本語のテキスト {line}\n" for line in range(40)),) for number in range(12)]
    windows = [len(text.encode()) for (text,) in PackedBlocks(ByteTokenizer(), 32).validation_texts(documents, 16)]
    assert sum(windows) <= 16 * 32 and min(windows) > 16 * 32 / 12 / 2  # a share of the bytes for each document


def test_validation_keeps_examples_that_1_2_4_and_8_devices_share_alike(train_urls):
    assert [shared_alike(count) for count in (0, 1, 3, 7, 8, 13, 20, 121)] == [0, 1, 2, 4, 8, 8, 16, 120]
    texts = [(sample["txt"].decode(),) for url in train_urls for sample in read_shard(url)]
    made = len(list(PackedBlocks(ByteTokenizer(), 16).examples(texts)))
    assert made % 8 and len(validation_blocks(train_urls, ByteTokenizer(), 16, max_blocks=100_000)) == made - made % 8


def test_middle_lines_and_shares():
    text = "".join(f"line {number}\n" for number in range(100))  # 7 or 8 characters a line
    assert middle_lines(text, 30) == "line 48\nline 49\nline 50\n" and middle_lines("short", 30) == "short"
    assert middle_lines("x" * 100, 10) == "x" * 10  # a single long line is cut
    assert len(middle_lines("a" * 905 + "\n" + "b" * 10 + "\n" + "c" * 1500, 600)) == 600  # lines longer than it
    assert middle_lines("日本語" * 100, 31).encode() == ("日本語" * 100).encode()[435:465]  # whole characters only
    assert shares([10, 1000, 50], 300) == [10, 240, 50] and shares([5, 5], 100) == [5, 5]


def test_validation_blocks_pack_across_shards_in_manifest_order(train_urls):
    urls = train_urls[:3]
    blocks = validation_blocks(urls, ByteTokenizer(), 16, max_blocks=100_000)  # every document, whole
    flat = [t for url in urls for document in shard_documents(url) for t in document]
    # One packer: no tail dropped per shard, the tokens run on across shards; the blocks left out are spread.
    packed_once = [flat[start : start + 17] for start in range(0, len(flat) - 16, 16)]
    kept = sorted(spread(shared_alike(len(packed_once)), len(packed_once)))
    assert [block["tokens"].tolist() for block in blocks] == [packed_once[index] for index in kept]


# --- ShardDataModule -----------------------------------------------------------------------------------


def test_datamodule_train_batches(shard_dir):
    dm = ShardDataModule(
        str(shard_dir), ByteTokenizer(), format=packed_blocks(32), global_batch_size=4, streams=1, num_workers=0
    )
    loader = dm.train_dataloader()
    assert loader.dataset.streams[0].shuffle_buffer == 4096
    batch = next(iter(loader))
    assert batch["tokens"].shape == (4, 33) and batch["tokens"].dtype == torch.int64
    assert batch["doc_ids"].shape == (4, 33) and batch["doc_ids"].dtype == torch.int64
    assert batch["target_bytes"].shape == (4,) and (batch["target_bytes"] > 0).all()
    assert batch["positions"].tolist() == [[0, 0, 0, 4]]  # source 0's sub-stream 0 continues after block 4 of shard 0
    assert batch["drawn"].tolist() == [4]  # the one source gave all four examples
    dm.on_before_batch_transfer(batch, 0)
    assert "positions" not in batch and dm.position.cursors == {(0, 0): Cursor(0, 4)}
    assert dm.position.batches_consumed == 1 and dm.position.drawn == [4]


def test_global_batch_in_tokens(shard_dir):
    dm = ShardDataModule(
        str(shard_dir), ByteTokenizer(), format=packed_blocks(32), global_batch_tokens=128, streams=1, num_workers=0
    )
    assert dm.global_batch_size == 4 and dm.plan_for(1) == BatchPlan(4, 4, 1, 1)
    with pytest.raises(
        ValueError, match=r"data\.global_batch_tokens=100 must be a multiple of the 32 tokens of one example"
    ):
        ShardDataModule(str(shard_dir), ByteTokenizer(), format=packed_blocks(32), global_batch_tokens=100)
    with pytest.raises(ValueError, match=r"exactly one of data\.global_batch_size"):
        ShardDataModule(
            str(shard_dir), ByteTokenizer(), format=packed_blocks(32), global_batch_size=4, global_batch_tokens=128
        )


def two_stream_datamodule(shard_dir: Path, val_size: int) -> ShardDataModule:
    """Blocks of 32 bytes, two per step from two streams, read in the main process."""
    return ShardDataModule(
        str(shard_dir),
        ByteTokenizer(),
        packed_blocks(32),
        global_batch_size=2,
        streams=2,
        num_workers=0,
        val_size=val_size,
    )


def test_datamodule_validation_is_split_across_ranks(shard_dir):
    blocks = validation_blocks(Manifest.load(shard_dir).urls("validation"), ByteTokenizer(), 32, 7)
    rows = []
    for rank in (0, 1):
        dm = two_stream_datamodule(shard_dir, val_size=7)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        mine = [tuple(row) for batch in dm.val_dataloader() for row in batch["tokens"].tolist()]
        assert mine == [tuple(b["tokens"].tolist()) for b in blocks[rank::2]]
        rows.append(mine)
    assert len(blocks) == 4 and len(rows[0]) == len(rows[1]) == 2  # 7 asked, 4 kept: an equal share for 1, 2, 4
    assert set(rows[0]).isdisjoint(rows[1])


def test_datamodule_validation_needs_a_block_per_rank(shard_dir):
    dm = two_stream_datamodule(shard_dir, val_size=1)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than 2 ranks"):
        dm.val_dataloader()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("global_batch_size", 0),
        ("micro_batch_size", 0),
        ("streams", 0),
        ("num_workers", -1),
        ("shuffle_buffer", 0),
        ("val_size", 0),
    ],
)
def test_datamodule_rejects_invalid_values(shard_dir, key, value):
    kwargs = {"format": packed_blocks(32), "global_batch_size": 4, "num_workers": 0, key: value}
    with pytest.raises(ValueError, match=rf"data\.{key}={value}"):
        ShardDataModule(str(shard_dir), ByteTokenizer(), **kwargs)


@pytest.mark.parametrize(
    ("format", "message"), [(packed_blocks(0), "block_size=0"), (tokenized_pairs(1, 8), "query_len=1")]
)
def test_formats_reject_invalid_lengths(format, message):
    with pytest.raises(ValueError, match=rf"data\.format\.{message} must be at least"):
        format(ByteTokenizer())


def test_datamodule_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="pretrain-data build"):
        ShardDataModule(str(tmp_path), ByteTokenizer(), format=packed_blocks(32), global_batch_size=4)


@pytest.mark.parametrize(("global_batch", "streams"), [(12, 4), (16, 8), (64, 8), (6, 2), (7, 1)])
def test_the_default_streams_divide_the_global_batch(global_batch: int, streams: int) -> None:
    assert default_streams(global_batch) == streams
    batch_plan(global_batch, None, default_streams(global_batch), 1)  # accepted


def test_a_global_batch_of_12_trains_with_the_default_streams(compose_train) -> None:
    cfg = compose_train("data.global_batch_size=12", "data.streams=null")
    data = build(cfg.data, tokenizer=ByteTokenizer())
    assert data.streams == 4 and data.plan_for(2).chunk == 3


def test_a_document_longer_than_the_shuffle_buffer_is_warned_about(tmp_path) -> None:
    """A document of 40 blocks behind a buffer of 16: its blocks would train nearly in order."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "large.txt").write_text("x" * (40 * BLOCK))
    (corpus / "small.txt").write_text("y" * (3 * BLOCK))
    settings = BuildSettings(validation_fraction=0.0)
    build_shards(read_source(str(corpus)), tmp_path / "shards", [str(corpus)], settings, show_progress=False)
    urls = Manifest.load(tmp_path / "shards").urls("train")
    with pytest.warns(
        UserWarning, match=r"more than data\.shuffle_buffer=16 blocks in a row.*raise data\.shuffle_buffer"
    ):
        list(itertools.islice(stream(urls, shuffle_buffer=16).examples(0, 1, Cursor()), 43))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(itertools.islice(stream(urls, shuffle_buffer=64).examples(0, 1, Cursor()), 43))
