"""Hard negatives: `pretrain-data negatives` mines, for every pair, the training passages BM25 ranks best for its
query (as an independent term-by-term BM25 ranks them), never its own passage or a pair sharing its texts, into a
new dataset, the same on every mining; `data.format.hard_negatives` reads them, and every query is scored against
them in the loss."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretraining.data.manifest import PAIR_FIELDS, Manifest, negative_fields
from pretraining.data.negatives import mine_negatives
from pretraining.data.reader import SampleReader
from pretraining.errors import ConfigError, ShardError
from pretraining.objectives.contrastive import clip_loss, sigmoid_loss

MINED = 3  # conftest's negatives_dir


def read_pairs(directory: Path, split: str, fields: tuple[str, ...]) -> list[tuple[str, ...]]:
    manifest = Manifest.load(directory)
    return list(SampleReader(fields).all_texts(manifest.urls(split)))


def bm25_ranking(query: str, passages: list[str]) -> list[int]:
    """Every passage by BM25 (k1 1.2, b 0.75, Lucene's idf) for `query`, word by word, best first (ties: earlier)."""
    bags = [Counter(re.findall(r"[a-z]+|[0-9]+", passage.lower())) for passage in passages]
    mean_length = sum(bag.total() for bag in bags) / len(bags)
    df = Counter(word for bag in bags for word in bag)
    words = Counter(re.findall(r"[a-z]+|[0-9]+", query.lower()))

    def score(bag: Counter) -> float:
        norm = 1.2 * (0.25 + 0.75 * bag.total() / mean_length)
        return sum(
            count * math.log(1 + (len(bags) - df[word] + 0.5) / (df[word] + 0.5)) * bag[word] * 2.2 / (bag[word] + norm)
            for word, count in words.items()
            if word in bag
        )

    scores = [score(bag) for bag in bags]
    return sorted(range(len(passages)), key=lambda row: (-scores[row], row))


def test_each_pair_gets_bm25s_best_training_passages_but_its_own(pair_dir: Path, negatives_dir: Path) -> None:
    training = read_pairs(pair_dir, "train", PAIR_FIELDS)
    passages = [passage for _, passage in training]
    fields = (*PAIR_FIELDS, *negative_fields(MINED))
    for split in ("train", "validation"):
        mined = read_pairs(negatives_dir, split, fields)
        assert [pair[:2] for pair in mined] == read_pairs(pair_dir, split, PAIR_FIELDS)  # the pairs, in order
        for query, passage, *negatives in mined[:40]:
            ranking = [passages[row] for row in bm25_ranking(query, passages) if passages[row] != passage]
            assert passage not in negatives
            # float32 against float64 sums: the order may differ only between (near-)equal scores
            assert negatives == ranking[:MINED] or set(negatives) <= set(ranking[: MINED + 2])
    manifest = json.loads((negatives_dir / "manifest.json").read_text())
    assert manifest["fields"] == list(fields) and manifest["hard_negatives"]["count"] == MINED
    assert (negatives_dir / "tokenizer.json").read_bytes() == (pair_dir / "tokenizer.json").read_bytes()


def test_mining_again_gives_the_same_dataset(pair_dir: Path, negatives_dir: Path, tmp_path: Path) -> None:
    again = mine_negatives(str(pair_dir), str(tmp_path / "again"), MINED)
    assert again["version"] == json.loads((negatives_dir / "manifest.json").read_text())["version"]
    assert again["version"] != Manifest.load(pair_dir).version


def test_bad_input_stops_in_one_line_and_leaves_nothing(pair_dir: Path, shard_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ShardError, match=r"--data='query.txt' and --data='passage.txt': not a field of every sample"):
        mine_negatives(str(shard_dir), str(out), 2)
    with pytest.raises(ShardError, match=r"training pairs: too few for 100000 negatives each"):
        mine_negatives(str(pair_dir), str(out), 100_000)
    with pytest.raises(ShardError, match=r"--count=0: mine at least one"):
        mine_negatives(str(pair_dir), str(out), 0)
    assert not out.exists()
    command = [str(Path(sys.executable).parent / "pretrain-data"), "negatives", "--data", str(tmp_path / "none")]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 1 and "the directory does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_format_reads_the_negatives_and_refuses_shards_without(
    compose_train, negatives_dir: Path, pair_dir: Path
) -> None:
    from pretraining.instantiate import build

    cfg = compose_train(f"data.dir={negatives_dir}", "data.format.hard_negatives=2", experiment="contrastive_tiny")
    data = build(cfg.data, tokenizer=build(cfg.tokenizer))
    example = data.validation_sets[0][0]
    assert example["negatives"].shape == (2, cfg.data.format.passage_len)
    assert data.format.example_tokens == cfg.data.format.query_len + 3 * cfg.data.format.passage_len
    cfg = compose_train(f"data.dir={pair_dir}", "data.format.hard_negatives=2", experiment="contrastive_tiny")
    with pytest.raises(ShardError, match=r"data.format.hard_negatives='negative2.txt'.*pretrain-data negatives"):
        build(cfg.data, tokenizer=build(cfg.tokenizer))
    cfg = compose_train(f"data.dir={negatives_dir}", "data.format.hard_negatives=-1", experiment="contrastive_tiny")
    with pytest.raises(ConfigError, match=r"hard_negatives"):
        build(cfg.data, tokenizer=build(cfg.tokenizer))


@pytest.mark.parametrize("loss", ["clip", "sigmoid"])
def test_every_query_is_scored_against_the_negatives_too(loss: str) -> None:
    queries, passages = F.normalize(torch.randn(2, 5, 8), dim=-1)
    negatives = F.normalize(torch.randn(10, 8), dim=-1)
    candidates = torch.cat([passages, negatives])
    scale, labels = torch.tensor(3.0), torch.arange(5)
    if loss == "clip":
        given = clip_loss(queries, passages, queries, candidates, scale)
        by_hand = (
            F.cross_entropy(scale * queries @ candidates.T, labels)
            + F.cross_entropy(scale * passages @ queries.T, labels)
        ) / 2
    else:
        given = sigmoid_loss(queries, candidates, scale, torch.tensor(-1.0))
        signs = -torch.ones(5, 15)
        signs[labels, labels] = 1
        by_hand = -F.logsigmoid(signs * (scale * queries @ candidates.T - 1)).sum() / 5
    assert torch.allclose(given, by_hand)
    assert not torch.allclose(
        given, clip_loss(queries, passages, queries, passages, scale) if loss == "clip" else given + 1
    )


def test_a_run_trains_on_them(compose_train, negatives_dir: Path) -> None:
    from pretraining.train import train

    overrides = [f"data.dir={negatives_dir}", "data.format.hard_negatives=2", "trainer.max_steps=2"]
    cfg = compose_train(*overrides, experiment="contrastive_tiny")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and "val/q2p_mrr" in metrics
