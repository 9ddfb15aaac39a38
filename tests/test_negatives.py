"""Hard negatives: `pretrain-data negatives` mines, for every pair, the training passages BM25 ranks best for its
query (as an independent term-by-term BM25 ranks them), never its own passage or a pair sharing its texts, into a
new dataset, the same on every mining; `data.format.hard_negatives` reads them, and every query is scored against
them in the loss."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretraining.data.manifest import PAIR_FIELDS, Manifest, negative_fields
from pretraining.data.negatives import mine, mine_negatives
from pretraining.data.reader import SampleReader
from pretraining.errors import ConfigError, ShardError
from pretraining.instantiate import build
from pretraining.objectives.base import build_objective

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
    parent = tmp_path / "pairs"
    shutil.copytree(pair_dir, parent)
    again = mine_negatives(str(parent), str(tmp_path / "again"), MINED)
    assert again["version"] == json.loads((negatives_dir / "manifest.json").read_text())["version"]
    assert again["version"] != Manifest.load(pair_dir).version
    (parent / "tokenizer.json").write_text("{}")  # a tokenizer trained again: mining again brings it along
    mine_negatives(str(parent), str(tmp_path / "again"), MINED)
    assert (tmp_path / "again" / "tokenizer.json").read_text() == "{}"
    with pytest.raises(ShardError, match=r"is --data itself"):
        mine_negatives(str(parent), str(parent), MINED)


def test_the_pairs_records_are_carried_over(pair_dir: Path, negatives_dir: Path) -> None:
    field = ("json:source_id",)
    assert read_pairs(negatives_dir, "validation", field) == read_pairs(pair_dir, "validation", field)


def test_a_pair_that_shares_its_texts_with_all_but_a_few_is_refused() -> None:
    pairs = [("find the key", "def find(key): ..."), ("other", "x = 1"), ("third", "y = 2")]
    assert mine(pairs[:1], pairs, 2) == [[1, 2]]
    with pytest.raises(ShardError, match=r"shares its texts with all but 2 training pairs: too few for 3"):
        mine(pairs[:1], [*pairs, pairs[0]], 3)


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


@pytest.mark.parametrize(("loss", "chunk"), [("clip", None), ("sigmoid", None), ("clip", 3)])
def test_every_query_is_scored_against_the_negatives_but_its_own_passage(
    compose_train, negatives_dir: Path, loss: str, chunk: int | None
) -> None:
    """`training_loss` against the loss written out: the pairs' passages and all negatives as every query's
    candidates, and a negative that is a pair's own passage (mined for another pair) left out for that pair."""
    overrides = [f"data.dir={negatives_dir}", "data.format.hard_negatives=2", f"model.loss={loss}"]
    cfg = compose_train(*overrides, f"model.grad_cache_chunk={chunk or 'null'}", experiment="contrastive_tiny")
    cfg.model.backbone.dropout = 0.0
    data = build(cfg.data, tokenizer=build(cfg.tokenizer))
    model = build_objective(cfg.model, data.format)
    pairs = data.validation_sets[0][:5]
    batch = {key: torch.stack([pair[key] for pair in pairs]) for key in ("query", "passage", "negatives")}
    batch["negatives"][0, 1] = batch["passage"][3]  # pair 3's passage, a negative of pair 0
    queries, passages = model.encode(batch["query"], "query"), model.encode(batch["passage"], "passage")
    negatives = model.encode(batch["negatives"].flatten(0, 1), "passage")
    logits = model.logit_scale.exp() * queries @ torch.cat([passages, negatives]).T
    own = torch.zeros_like(logits, dtype=torch.bool)
    own[3, 5 + 1] = True  # the column of negative (0, 1) in row 3

    def written_out(left_out: torch.Tensor) -> torch.Tensor:
        if loss == "clip":
            labels = torch.arange(5)
            p2q = F.cross_entropy(model.logit_scale.exp() * passages @ queries.T, labels)
            return (F.cross_entropy(logits.masked_fill(left_out, float("-inf")), labels) + p2q) / 2
        signs = -torch.ones_like(logits)
        signs[range(5), range(5)] = 1
        return -F.logsigmoid(signs * (logits + model.logit_bias)).masked_fill(left_out, 0).sum() / 5

    loss_value = model.training_loss(batch)
    torch.testing.assert_close(loss_value, written_out(own))
    assert not torch.allclose(loss_value, written_out(torch.zeros_like(own)))  # the false negative counts


def test_a_run_trains_on_them(compose_train, negatives_dir: Path) -> None:
    from pretraining.train import train

    overrides = [f"data.dir={negatives_dir}", "data.format.hard_negatives=2", "trainer.max_steps=2"]
    cfg = compose_train(*overrides, experiment="contrastive_tiny")
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and "val/q2p_mrr" in metrics
