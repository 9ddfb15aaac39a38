"""Packing, the resumable shard stream, validation blocks and the DataModule."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pretraining.data.corpus import read_source
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.shards import BuildSettings, Manifest, build_shards
from pretraining.data.stream import (
    Cursor,
    ShardStream,
    block_sample,
    buffer_shuffled,
    encode_sample,
    pack_blocks,
    read_shard,
    seeded_rng,
    shard_order,
    validation_blocks,
    worker_shard,
)
from pretraining.data.tokenizer import EOS_ID, ByteTokenizer

BLOCK = 32
SEED = 7
BUFFER = 4
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
    assert len(urls) >= 4
    return urls


@pytest.fixture(scope="module")
def train_documents(train_urls) -> list[tuple[int, ...]]:
    """Every training document's tokens (with EOS), read straight from the shards."""
    tokenizer = ByteTokenizer()
    return [tuple(encode_sample(tokenizer, sample)) for url in train_urls for sample in read_shard(url)]


def take(dataset, count: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(dataset), count))


def plain(sample: dict[str, torch.Tensor]) -> tuple:
    return (
        sample["tokens"].tolist(),
        sample["doc_ids"].tolist(),
        sample["cursor"].tolist(),
        int(sample["target_bytes"]),
        sample["worker"].tolist(),
    )


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


def handmade_documents(seed: int = 0) -> list[tuple[Cursor, list[int]]]:
    rng = random.Random(seed)
    lengths = [3, 1, 17, 8, 60, 2, 9, 31, 32, 33, 5, 1, 1, 70, 4, 12, 16, 0, 7, 24]
    documents = []
    for number, length in enumerate(lengths):
        tokens = [rng.randrange(4, 260) for _ in range(length)] + [EOS_ID]
        documents.append((Cursor(number // 3, number % 3, 0), tokens))
    return documents


def resumed(documents: list[tuple[Cursor, list[int]]], start: Cursor):
    """What `ShardStream.documents` yields from `start`: earlier documents skipped, the first one sliced."""
    for cursor, tokens in documents:
        if (cursor.shard, cursor.sample) < (start.shard, start.sample):
            continue
        skip = start.token if (cursor.shard, cursor.sample) == (start.shard, start.sample) else 0
        yield replace(cursor, token=skip), tokens[skip:]


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 32])
def test_pack_blocks_loses_and_duplicates_nothing(block_size):
    documents = handmade_documents()
    stream = [token for _, tokens in documents for token in tokens]
    blocks = list(pack_blocks(iter(documents), block_size))
    assert len(blocks) == (len(stream) - 1) // block_size
    for block in blocks:
        assert len(block.tokens) == len(block.doc_ids) == block_size + 1
    for before, after in itertools.pairwise(blocks):
        assert before.tokens[-1] == after.tokens[0]
    assert unpack([b.tokens for b in blocks]) == stream[: 1 + len(blocks) * block_size]


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 32])
def test_pack_blocks_doc_ids(block_size):
    documents = handmade_documents()
    document_of_token = [number for number, (_, tokens) in enumerate(documents) for _ in tokens]
    for index, block in enumerate(pack_blocks(iter(documents), block_size)):
        assert block.doc_ids[0] == 0
        for j in range(1, len(block.tokens)):
            assert block.doc_ids[j] == block.doc_ids[j - 1] + (block.tokens[j - 1] == EOS_ID)
        first = document_of_token[index * block_size]
        absolute = document_of_token[index * block_size : index * block_size + block_size + 1]
        assert block.doc_ids == [d - first for d in absolute]


@pytest.mark.parametrize("block_size", [1, 4, 7, 16, 32])
def test_pack_blocks_cursor_restarts_exactly(block_size):
    documents = handmade_documents()
    blocks = list(pack_blocks(iter(documents), block_size))
    lengths = {(c.shard, c.sample): len(tokens) for c, tokens in documents}
    for k, block in enumerate(blocks):
        start = block.next
        assert 0 <= start.token < lengths[(start.shard, start.sample)]
        again = list(pack_blocks(resumed(documents, start), block_size))
        assert again == blocks[k + 1 :], k


def test_pack_blocks_cursor_points_at_next_block_start():
    documents = handmade_documents()
    by_position = {(c.shard, c.sample): tokens for c, tokens in documents}
    blocks = list(pack_blocks(iter(documents), 16))
    for block, following in itertools.pairwise(blocks):
        cursor = block.next
        assert by_position[(cursor.shard, cursor.sample)][cursor.token] == following.tokens[0]


def test_pack_blocks_short_input_gives_no_block():
    assert list(pack_blocks(iter([(Cursor(), [5, 6, EOS_ID])]), 3)) == []
    (block,) = pack_blocks(iter([(Cursor(), [5, 6, EOS_ID]), (Cursor(0, 1), [EOS_ID])]), 3)
    assert block.tokens == [5, 6, EOS_ID, EOS_ID]
    assert block.doc_ids == [0, 0, 0, 1]


def test_encode_sample_appends_eos():
    tokenizer = ByteTokenizer()
    assert encode_sample(tokenizer, {"txt": "é!".encode()}) == [*tokenizer.encode("é!"), EOS_ID]


def test_block_sample_counts_target_bytes():
    tokenizer = ByteTokenizer()
    (block,) = pack_blocks(iter([(Cursor(), [*tokenizer.encode("abc"), EOS_ID, *tokenizer.encode("d")])]), 4)
    sample = block_sample(block, tokenizer.token_bytes, worker=3)
    assert sample["tokens"].dtype == torch.int64 and sample["tokens"].tolist() == block.tokens
    assert int(sample["target_bytes"]) == 3  # b, c, d: the first token is no target and EOS has no bytes
    weights = np.arange(300, dtype=np.int64)
    assert int(block_sample(block, weights)["target_bytes"]) == sum(block.tokens[1:])
    assert int(sample["worker"]) == 3
    assert sample["cursor"].tolist() == [block.next.shard, block.next.sample, block.next.token]


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
            assert worker_shard(ordinal, worker, workers, num_shards, SEED) == (
                epoch,
                orders[epoch][position % num_shards],
            )
    assert len({tuple(shard_order(8, SEED, epoch)) for epoch in range(5)}) > 1
    assert shard_order(8, SEED, 0) != shard_order(8, SEED + 1, 0)


# --- ShardStream ---------------------------------------------------------------------------------------


def stream(urls, seed=SEED, **kwargs) -> ShardStream:
    return ShardStream(urls, ByteTokenizer(), BLOCK, seed, shuffle_buffer=BUFFER, **kwargs)


@pytest.fixture(scope="module")
def reference(train_urls) -> list[dict[str, torch.Tensor]]:
    return take(stream(train_urls), 420)


def epoch_of(cursor: Cursor, urls, worker: int = 0, workers: int = 1) -> int:
    return worker_shard(cursor.shard, worker, workers, len(urls), SEED)[0]


def test_stream_blocks_are_well_formed(reference, train_urls, train_documents):
    tokenizer = ByteTokenizer()
    for sample in reference:
        assert sample["tokens"].shape == (BLOCK + 1,) and sample["tokens"].dtype == torch.int64
        assert int(sample["target_bytes"]) == int(tokenizer.token_bytes[sample["tokens"][1:].numpy()].sum())
        assert int(sample["worker"]) == 0
    # The blocks are the worker's documents (each ending in one EOS) laid end to end.
    documents = stream(train_urls).documents(0, 1, Cursor())
    flat = [t for _, tokens in itertools.islice(documents, 200) for t in tokens]
    unpacked = unpack([s["tokens"].tolist() for s in reference])
    assert unpacked == flat[: len(unpacked)]
    for document in train_documents:
        assert document[-1] == EOS_ID and EOS_ID not in document[:-1]


def test_stream_wraps_epochs(reference, train_urls):
    epochs = [epoch_of(cursor_of(s), train_urls) for s in reference]
    assert epochs == sorted(epochs)
    assert epochs[-1] >= 2


def test_stream_is_deterministic_and_seeded(reference, train_urls):
    assert [plain(s) for s in take(stream(train_urls), len(reference))] == [plain(s) for s in reference]
    other = take(stream(train_urls, seed=SEED + 1), 60)
    assert [plain(s)[0] for s in other] != [plain(s)[0] for s in reference[:60]]


def shard_orders(urls, seed: int, epochs: int) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """(epoch, shard) -> that shard's documents in the order the single worker reads them."""
    orders: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for cursor, tokens in stream(urls, seed=seed).documents(0, 1, Cursor()):
        epoch, shard = worker_shard(cursor.shard, 0, 1, len(urls), seed)
        if epoch >= epochs:
            return orders
        orders.setdefault((epoch, shard), []).append(tuple(tokens))
    raise AssertionError("unreachable")


def test_order_inside_a_shard_depends_on_seed_and_epoch(train_urls):
    orders = shard_orders(train_urls, SEED, 2)
    others = shard_orders(train_urls, SEED + 1, 2)
    shards = range(len(train_urls))
    for shard in shards:
        assert sorted(orders[(0, shard)]) == sorted(orders[(1, shard)]) == sorted(others[(0, shard)])
    assert any(orders[(0, shard)] != orders[(1, shard)] for shard in shards)
    assert any(orders[(0, shard)] != others[(0, shard)] for shard in shards)
    assert shard_orders(train_urls, SEED, 2) == orders


def test_stream_resumes_exactly_from_any_cursor(reference, train_urls):
    cursors = [cursor_of(s) for s in reference]
    epochs = [epoch_of(c, train_urls) for c in cursors]
    shard_changes = [k for k in range(1, len(cursors)) if cursors[k].shard != cursors[k - 1].shard]
    epoch_changes = [k for k in range(1, len(cursors)) if epochs[k] != epochs[k - 1]]
    assert len(shard_changes) >= 4 and len(epoch_changes) >= 2
    ks = {0, 1, 2, len(reference) // 2, len(reference) - 2}
    for k in shard_changes[:3] + epoch_changes[:2]:
        ks |= {k - 1, k, k + 1}
    for k in sorted(ks):
        again = take(stream(train_urls, cursors=[cursors[k]]), len(reference) - k - 1)
        assert [plain(s) for s in again] == [plain(s) for s in reference[k + 1 :]], k


def test_stream_rejects_cursor_count_mismatch(train_urls):
    with pytest.raises(ValueError, match="2 stream cursors for 1"):
        take(stream(train_urls, cursors=[Cursor(), Cursor()]), 1)


def epoch_documents(dataset: ShardStream, worker: int, workers: int, epoch: int) -> list[tuple[int, ...]]:
    documents = dataset.documents(worker, workers, Cursor())
    out = []
    for cursor, tokens in documents:
        seen = epoch_of(cursor, dataset.urls, worker, workers)
        if seen > epoch:
            break
        if seen == epoch:
            out.append(tuple(tokens))
    return out


@pytest.mark.parametrize("num_shards", [3, 4])
def test_ranks_split_each_epoch(train_urls, num_shards):
    urls = train_urls[:num_shards]
    tokenizer = ByteTokenizer()
    everything = sorted(tuple(encode_sample(tokenizer, s)) for url in urls for s in read_shard(url))
    for epoch in (0, 1):
        per_rank = [epoch_documents(stream(urls, rank=r, world_size=2), r, 2, epoch) for r in (0, 1)]
        assert set(per_rank[0]).isdisjoint(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == everything
        dealt = [[worker_shard(k, r, 2, num_shards, SEED) for k in range(3 * num_shards)] for r in (0, 1)]
        shards = [[shard for seen, shard in rank if seen == epoch] for rank in dealt]
        assert sorted(shards[0] + shards[1]) == list(range(num_shards))


def test_ranks_stream_different_blocks(train_urls):
    rank0 = take(stream(train_urls, rank=0, world_size=2), 20)
    rank1 = take(stream(train_urls, rank=1, world_size=2), 20)
    assert {tuple(s["tokens"].tolist()) for s in rank0}.isdisjoint(tuple(s["tokens"].tolist()) for s in rank1)


def loader(urls, cursors=None) -> DataLoader:
    return DataLoader(stream(urls, cursors=cursors), batch_size=4, num_workers=2)


def test_dataloader_workers_alternate_and_resume(train_urls):
    batches = take(loader(train_urls), 12)
    for index, batch in enumerate(batches):
        assert batch["tokens"].shape == (4, BLOCK + 1)
        assert batch["worker"].tolist() == [index % 2] * 4
    # Each worker is the global worker `id` of 2: the same blocks a rank of a 2-rank world would read alone.
    for worker in (0, 1):
        alone = take(stream(train_urls, rank=worker, world_size=2), 4 * 6)
        mine = [row for batch in batches[worker::2] for row in batch["tokens"].tolist()]
        assert mine == [s["tokens"].tolist() for s in alone]
    # Restart after batch 7 (worker 1's turn just ended) with each worker's last cursor.
    consumed = 8
    last = {int(b["worker"][-1]): Cursor(*b["cursor"][-1].tolist()) for b in batches[:consumed]}
    again = take(loader(train_urls, cursors=[last[0], last[1]]), len(batches) - consumed)
    for original, repeated in zip(batches[consumed:], again, strict=True):
        for key in ("tokens", "doc_ids", "cursor", "target_bytes", "worker"):
            assert torch.equal(original[key], repeated[key]), key
    # After an odd count the restarted loader starts with worker 0 again, but each worker's own
    # continuation is still exact.
    consumed = 5
    last = {int(b["worker"][-1]): Cursor(*b["cursor"][-1].tolist()) for b in batches[:consumed]}
    again = take(loader(train_urls, cursors=[last[0], last[1]]), 6)
    for worker in (0, 1):
        expected = [b["tokens"].tolist() for b in batches[consumed:] if int(b["worker"][0]) == worker][:3]
        assert [b["tokens"].tolist() for b in again if int(b["worker"][0]) == worker] == expected


# --- validation blocks ---------------------------------------------------------------------------------


def test_validation_blocks(shard_dir):
    urls = Manifest.load(shard_dir).urls("validation")
    tokenizer = ByteTokenizer()
    everything = validation_blocks(urls, tokenizer, 16, max_blocks=10_000)
    flat = [t for url in urls for s in read_shard(url) for t in encode_sample(tokenizer, s)]
    assert len(everything) == (len(flat) - 1) // 16 > 6
    assert unpack([b["tokens"].tolist() for b in everything]) == flat[: 1 + 16 * len(everything)]
    first = validation_blocks(urls, tokenizer, 16, max_blocks=5)
    assert len(first) == 5
    assert [plain(b) for b in first] == [plain(b) for b in everything[:5]]
    assert [plain(b) for b in validation_blocks(urls, tokenizer, 16, max_blocks=5)] == [plain(b) for b in first]


# --- ShardDataModule -----------------------------------------------------------------------------------


def test_datamodule_train_batches(shard_dir):
    dm = ShardDataModule(dir=str(shard_dir), tokenizer=ByteTokenizer(), block_size=32, batch_size=4, num_workers=0)
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, 33) and batch["tokens"].dtype == torch.int64
    assert batch["doc_ids"].shape == (4, 33) and batch["doc_ids"].dtype == torch.int64
    assert batch["target_bytes"].shape == (4,) and (batch["target_bytes"] > 0).all()
    assert batch["cursor"].shape == (4, 3)
    assert batch["worker"].tolist() == [0, 0, 0, 0]


def test_datamodule_validation_is_split_across_ranks(shard_dir):
    blocks = validation_blocks(Manifest.load(shard_dir).urls("validation"), ByteTokenizer(), 32, 7)
    rows = []
    for rank in (0, 1):
        dm = ShardDataModule(str(shard_dir), ByteTokenizer(), block_size=32, batch_size=2, num_workers=0, val_blocks=7)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        mine = [tuple(row) for batch in dm.val_dataloader() for row in batch["tokens"].tolist()]
        assert mine == [tuple(b["tokens"].tolist()) for b in blocks[rank::2][:3]]
        rows.append(mine)
    assert len(rows[0]) == len(rows[1]) == 3
    assert set(rows[0]).isdisjoint(rows[1])


def test_datamodule_validation_needs_a_block_per_rank(shard_dir):
    dm = ShardDataModule(str(shard_dir), ByteTokenizer(), block_size=32, batch_size=2, num_workers=0, val_blocks=1)
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than 2 ranks"):
        dm.val_dataloader()


@pytest.mark.parametrize(
    ("key", "value"),
    [("block_size", 0), ("batch_size", 0), ("num_workers", -1), ("shuffle_buffer", 0), ("val_blocks", 0)],
)
def test_datamodule_rejects_invalid_values(shard_dir, key, value):
    kwargs = {"block_size": 32, "batch_size": 4, "num_workers": 0, key: value}
    with pytest.raises(ValueError, match=rf"data\.{key}={value}"):
        ShardDataModule(str(shard_dir), ByteTokenizer(), **kwargs)


def test_datamodule_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="pretrain-data build"):
        ShardDataModule(str(tmp_path), ByteTokenizer(), block_size=32, batch_size=4)
