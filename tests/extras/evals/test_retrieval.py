"""Retrieval for contrastive models: the metrics are InformationRetrievalEvaluator's (by hand, on its own code,
and on a trained checkpoint against its sentence-transformers export), the same in any batching or number of
ranks, and every bad task file is refused in one line naming it."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from sentence_transformers import SentenceTransformer
from sentence_transformers.evaluation import InformationRetrievalEvaluator
from sentence_transformers.util import cos_sim

from conftest import tiny_run
from pretraining.config import CONFIG_DIR
from pretraining.data.formats import padded
from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import ConfigError, MissingFileError
from pretraining.evaluate import build_from_checkpoint
from pretraining.extras.evals import task as task_module
from pretraining.extras.evals.retrieval import RetrievalTask, document_text, ranked, retrieval_metrics
from pretraining.models.transformer import Transformer
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.stored import load_checkpoint
from pretraining.train import train

K_VALUES = (1, 3, 5, 10)
METRICS = ["ndcg@10", "mrr@10", *(f"recall@{k}" for k in K_VALUES), "accuracy@1", "map@100"]


def evaluator_metrics(results: dict[str, float]) -> dict[str, float]:
    """Our names for an evaluator's results (`cosine_ndcg@10` -> `ndcg@10`)."""
    return {name: float(results[f"cosine_{name}"]) for name in METRICS}


def evaluator_on(
    queries: torch.Tensor, corpus: torch.Tensor, corpus_ids: list[str], relevant: dict[str, set[str]]
) -> dict[str, float]:
    """InformationRetrievalEvaluator's metrics of fixed embeddings (a stand-in model returns the queries')."""
    query_ids = [f"q{i}" for i in range(len(queries))]
    evaluator = InformationRetrievalEvaluator(
        dict(zip(query_ids, query_ids, strict=True)),
        dict(zip(corpus_ids, corpus_ids, strict=True)),
        relevant,
        corpus_chunk_size=7,  # several chunks: its merge of chunk results is exercised too
        score_functions={"cosine": cos_sim},
        write_csv=False,
    )
    model = SimpleNamespace(encode_query=lambda *args, **kwargs: queries)
    scores = evaluator.compute_all_metrics(model, corpus_embeddings=corpus)["cosine"]
    groups = {"ndcg": "ndcg@k", "mrr": "mrr@k", "recall": "recall@k", "accuracy": "accuracy@k", "map": "map@k"}
    return {name: float(scores[groups[name.split("@")[0]]][int(name.split("@")[1])]) for name in METRICS}


def test_the_metrics_of_known_ranks_and_a_tie_equal_a_hand_computation() -> None:
    corpus = torch.eye(4)  # cosine similarity to document j: a query's j-th coordinate over its norm
    queries = torch.tensor([[3.0, 4, 1, 2], [4.0, 1, 2, 3], [1.0, 1, 0, 0]])
    # q0: its document 0 second; q1: documents 0 and 2, first and third; q2: 1, tied with 0, which goes first.
    metrics = retrieval_metrics(queries, corpus, [[0], [0, 2], [1]], (1, 3))
    log2 = math.log2
    expected = {
        "ndcg@10": (1 / log2(3) + (1 + 1 / log2(4)) / (1 + 1 / log2(3)) + 1 / log2(3)) / 3,
        "mrr@10": (1 / 2 + 1 + 1 / 2) / 3,
        "recall@1": (0 + 1 / 2 + 0) / 3,
        "recall@3": 1.0,
        "accuracy@1": 1 / 3,
        "map@100": (1 / 2 + (1 + 2 / 3) / 2 + 1 / 2) / 3,
    }
    assert metrics == pytest.approx(expected, abs=1e-12)


def axis_corpus(rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Scaled, signed axis vectors: a query's cosine with each is one product, exact whatever the matmul's shape
    (ties stay ties in every chunking), and many tie."""
    axes = torch.randint(dim, (rows,), generator=generator)
    signs = torch.randint(2, (rows,), generator=generator) * 2 - 1
    scales = torch.rand(rows, generator=generator) + 0.5
    return torch.nn.functional.one_hot(axes, dim).float() * (signs * scales)[:, None]


def test_the_metrics_equal_the_evaluators_with_ties_many_relevant_and_a_corpus_beyond_map_depth() -> None:
    generator = torch.Generator().manual_seed(0)
    corpus = axis_corpus(130, 4, generator)
    corpus[0] = 0  # a zero vector: cosine 0 with everything, as cos_sim makes it
    queries = torch.randn(25, 4, generator=generator)
    corpus_ids = [f"d{i}" for i in torch.randperm(130, generator=generator).tolist()]  # "d10" < "d9": by string
    wanted = [torch.randperm(130, generator=generator)[: 1 + i % 4].tolist() for i in range(25)]
    relevant = {f"q{i}": {corpus_ids[j] for j in rows} for i, rows in enumerate(wanted)}
    order = sorted(range(130), key=corpus_ids.__getitem__)  # the task's corpus order: by id
    position = {index: rank for rank, index in enumerate(order)}
    ours = retrieval_metrics(queries, corpus[order], [[position[j] for j in rows] for rows in wanted], K_VALUES)
    theirs = evaluator_on(queries, corpus, corpus_ids, relevant)
    assert ours == pytest.approx(theirs, abs=1e-6, rel=0)
    assert 0 < ours["ndcg@10"] < 1 and 0 < ours["map@100"] < 1


def test_the_ranking_does_not_depend_on_the_chunks_breaks_ties_by_index_and_puts_a_nan_last() -> None:
    generator = torch.Generator().manual_seed(1)
    queries, corpus = torch.randn(9, 3, generator=generator), axis_corpus(20, 3, generator)
    corpus[3] = float("nan")
    whole = ranked(queries, corpus, depth=20)
    assert torch.equal(ranked(queries, corpus, depth=20, chunk=3), whole)
    assert torch.equal(ranked(queries, corpus, depth=5, chunk=3), whole[:, :5])
    assert (whole[:, -1] == 3).all()
    scores = (queries @ torch.nn.functional.normalize(corpus).T).nan_to_num(float("-inf"))
    for row, top in zip(scores.tolist(), whole.tolist(), strict=True):
        assert top == sorted(range(20), key=lambda j, row=row: (-row[j], j))


# --- the task on files ---------------------------------------------------------------------------------------

CORPUS = [
    {"_id": "b", "title": "Sum", "text": "def add(a, b): return a + b"},
    {"_id": "a", "title": "", "text": "def sub(a, b): return a - b"},
    {"_id": "c", "text": "class Stack: pass"},
    {"_id": "d", "title": "Stack", "text": "def push(self, item): self.items.append(item)"},
]
QUERIES = [
    {"_id": "1", "text": "Add two numbers."},
    {"_id": "2", "text": "A stack."},
    {"_id": "3", "text": "Nothing relevant."},
    {"_id": "4", "text": "Subtract."},
]
QRELS = [("1", "b", 1), ("2", "c", 1), ("2", "d", 2), ("3", "a", 0), ("4", "a", 1)]


def write_task(directory: Path, corpus: list[Any] = CORPUS, queries: list[Any] = QUERIES, qrels: Any = QRELS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in corpus))
    (directory / "queries.jsonl").write_text("".join(json.dumps(row) + "\n" for row in queries))
    (directory / "qrels").mkdir(exist_ok=True)
    rows = ["query-id\tcorpus-id\tscore", *("\t".join(map(str, row)) for row in qrels)]
    (directory / "qrels" / "test.tsv").write_text("\n".join(rows) + "\n")
    return directory


def tiny_contrastive(seed: int = 0) -> Contrastive:
    torch.manual_seed(seed)
    backbone = Transformer(vocab_size=260, max_seq_len=48, d_model=32, n_layer=1, n_head=2, causal=False)
    return Contrastive(backbone, optimizer=partial(torch.optim.AdamW), embed_dim=16).eval()


PAIRS = TokenizedPairs(ByteTokenizer(), query_len=12, passage_len=48)


def direct_metrics(model: Contrastive) -> dict[str, float]:
    """The task's metrics computed here from each text's embedding: documents ordered by id, query 3 left out."""
    corpus = sorted(CORPUS, key=lambda row: row["_id"])
    ids = [row["_id"] for row in corpus]
    with torch.no_grad():
        passages = [padded(PAIRS.encode_text(document_text(row), 48), 48) for row in corpus]
        queries = [padded(PAIRS.encode_text(row["text"], 12), 12) for row in QUERIES if row["_id"] != "3"]
        embedded = model.encode(torch.stack(queries), "query"), model.encode(torch.stack(passages), "passage")
    relevant = [[ids.index("b")], [ids.index("c"), ids.index("d")], [ids.index("a")]]
    return retrieval_metrics(*embedded, relevant, K_VALUES)


def test_the_task_reads_the_files_joins_titles_and_scores_only_queries_with_a_relevant_document(
    tmp_path: Path,
) -> None:
    model = tiny_contrastive()
    task = RetrievalTask("toy", write_task(tmp_path / "toy"), PAIRS)
    task.check(model)
    assert task.data.corpus_ids == ["a", "b", "c", "d"] and task.data.query_ids == ["1", "2", "4"]
    assert task.data.passages[1] == PAIRS.encode_text("Sum def add(a, b): return a + b", 48)
    assert task.data.passages[0] == PAIRS.encode_text("def sub(a, b): return a - b", 48)  # no title: the text
    metrics = task.evaluate(model)
    assert set(metrics) == set(METRICS)
    assert metrics == pytest.approx(direct_metrics(model), abs=1e-6, rel=0)
    limited = RetrievalTask("toy", tmp_path / "toy", PAIRS, limit=1)
    assert limited.data.query_ids == ["1"] and len(limited.data.passages) == 4


def simulated_ranks(
    monkeypatch: pytest.MonkeyPatch, world: int, run: Callable[[], Any]
) -> tuple[list[Any], list[list[int]]]:
    """`run()` on each of `world` simulated ranks at once, a thread each, whose `gather` meets the others' as a
    process group's all-gather would: every rank's result, and the sizes of the ranks' parts at each gather."""
    local, slots, barrier = threading.local(), [None] * world, threading.Barrier(world, timeout=60)
    sizes: list[list[int]] = []

    def fake_gather(value: Any) -> list[Any]:
        slots[local.rank] = value
        barrier.wait()
        everyone = list(slots)
        if local.rank == 0:
            sizes.append([len(part) for part in everyone])
        barrier.wait()  # nobody writes the next gather's value before all have read this one's
        return everyone

    monkeypatch.setattr(task_module, "gather", fake_gather)
    monkeypatch.setattr(task_module, "rank_and_world", lambda: (local.rank, world))
    results: list[Any] = [None] * world

    def rank_run(rank: int) -> None:
        local.rank = rank
        results[rank] = run()

    threads = [threading.Thread(target=rank_run, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert None not in results, "a simulated rank failed or hung"
    return results, sizes


def test_batching_and_the_number_of_ranks_do_not_change_the_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, directory = tiny_contrastive(), write_task(tmp_path / "toy")
    expected = RetrievalTask("toy", directory, PAIRS).evaluate(model)
    assert RetrievalTask("toy", directory, PAIRS, batch_size=1).evaluate(model) == pytest.approx(expected, abs=1e-6)
    for world in (2, 3, 5):  # 5 ranks for 3 queries: some encode filler batches alone
        task = RetrievalTask("toy", directory, PAIRS, batch_size=2)
        results, sizes = simulated_ranks(monkeypatch, world, lambda task=task: task.evaluate(model))
        assert [sum(parts) for parts in sizes] == [3, 4] and max(sizes[1]) < 4  # the ranks' shares: queries, documents
        for metrics in results:
            assert metrics == pytest.approx(expected, abs=1e-6, rel=0)


def refusal(directory: Path, model: Any = None) -> str:
    with pytest.raises(ConfigError) as raised:
        RetrievalTask("toy", directory, PAIRS).check(model or tiny_contrastive())
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_each_bad_input_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    mlm = MaskedLM(
        Transformer(vocab_size=260, max_seq_len=16, d_model=16, n_layer=1, n_head=2, causal=False),
        optimizer=partial(torch.optim.AdamW),
    )
    assert "eval task toy" in refusal(write_task(tmp_path / "ok"), mlm) and "MaskedLM" in refusal(tmp_path / "ok", mlm)
    (tmp_path / "gone").mkdir()
    with pytest.raises(MissingFileError, match=r"corpus\.jsonl is missing"):
        RetrievalTask("toy", tmp_path / "gone", PAIRS).check(tiny_contrastive())
    bad = write_task(tmp_path / "json")
    (bad / "queries.jsonl").write_text('{"_id": "1", "text": "x"}\n{"_id": "2", "text": \n')
    assert refusal(bad).startswith(f"{bad / 'queries.jsonl'}:2: not JSON")
    fields = write_task(tmp_path / "fields", corpus=[*CORPUS, {"_id": "e", "body": "no text"}])
    assert refusal(fields).startswith(f"{fields / 'corpus.jsonl'}:5: must be a JSON object")
    twice = write_task(tmp_path / "twice", queries=[*QUERIES, QUERIES[0]])
    assert refusal(twice) == f"{twice / 'queries.jsonl'}:5: _id '1' appears twice: ids must be unique"
    qrels = tmp_path / "qrels" / "qrels" / "test.tsv"
    write_task(tmp_path / "qrels", qrels=[*QRELS, ("9", "a", 1)])
    assert refusal(tmp_path / "qrels") == f"{qrels}:7: '9' is not an _id of queries.jsonl"
    write_task(tmp_path / "qrels", qrels=[("1", "zz", 1)])
    assert refusal(tmp_path / "qrels") == f"{qrels}:2: 'zz' is not an _id of corpus.jsonl"
    write_task(tmp_path / "qrels", qrels=[("1", "a", "high")])
    assert refusal(tmp_path / "qrels").startswith(f"{qrels}:2: must be query-id, corpus-id and an integer score")
    write_task(tmp_path / "qrels", qrels=[("1", "a", 0), ("2", "b", -1)])
    assert refusal(tmp_path / "qrels") == f"{qrels} has no relevant pair (a score above 0): there is nothing to score"
    qrels.write_text("q\tc\ts\n1\ta\t1\n")
    assert refusal(tmp_path / "qrels").startswith(f"{qrels}:1: the header must be")
    with pytest.raises(ConfigError, match="k_values"):
        RetrievalTask("toy", tmp_path, PAIRS, k_values=(0,))


# --- parity with sentence-transformers on a trained checkpoint -------------------------------------------------


def parity_task(directory: Path, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """A BEIR task of (docstring, code) pairs, each query relevant to its own code, one to two documents."""
    corpus = [{"_id": f"doc{i}", "title": "", "text": code} for i, (_, code) in enumerate(pairs)]
    queries = [{"_id": f"q{i}", "text": docstring} for i, (docstring, _) in enumerate(pairs)]
    qrels = [(f"q{i}", f"doc{i}", 1) for i in range(len(pairs))] + [("q0", "doc1", 1)]
    write_task(directory, corpus, queries, qrels)
    relevant = {query: {document for q, document, _ in qrels if q == query} for query, _, _ in qrels}
    return {
        "queries": {row["_id"]: row["text"] for row in queries},
        "corpus": {row["_id"]: document_text(row) for row in corpus},
        "relevant_docs": relevant,
    }


def test_the_task_on_a_checkpoint_equals_the_evaluator_on_its_sentence_transformers_export(
    tmp_path: Path, pair_dir: Path
) -> None:
    export = pytest.importorskip("pretraining.extras.hf.export", reason="the parity test exports with hf").export
    # query_len = passage_len: the export embeds every text as a passage, cut to passage_len tokens.
    overrides = [f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs", f"data.dir={pair_dir}"]
    overrides += [*tiny_run("contrastive_tiny"), "data.format.query_len=64", "trainer.max_steps=6"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        train(compose("train", overrides=overrides))
    checkpoint_path = tmp_path / "checkpoints" / "last.ckpt"
    export(checkpoint_path, tmp_path / "export")
    model, datamodule = build_from_checkpoint(load_checkpoint(checkpoint_path), str(checkpoint_path), {})
    pairs = [
        (f"Return {word} of a and b.", f"def {word.replace(' ', '_')}(a, b):\n    return a {op} b")
        for word, op in OPERATIONS
    ]
    pairs.append(("Return a long sum.", "def long_sum(a):\n" + "    a = a + 1\n" * 40 + "    return a"))  # cut to 64
    files = parity_task(tmp_path / "task", pairs)
    ours = RetrievalTask("parity", tmp_path / "task", datamodule.format, batch_size=5).evaluate(model.eval())
    encoder = SentenceTransformer(str(tmp_path / "export"), trust_remote_code=True, device="cpu")
    evaluator = InformationRetrievalEvaluator(**files, write_csv=False, batch_size=5)
    theirs = evaluator_metrics(evaluator(encoder))
    assert ours == pytest.approx(theirs, abs=1e-6, rel=0)
    assert 0 < ours["ndcg@10"] < 1 and ours["recall@1"] < ours["recall@10"]  # a model between chance and perfect


OPERATIONS = [
    ("the sum", "+"), ("the difference", "-"), ("the product", "*"), ("the quotient", "/"), ("the remainder", "%"),
    ("the power", "**"), ("the floor quotient", "//"), ("the bitwise and", "&"), ("the bitwise or", "|"),
    ("the bitwise xor", "^"), ("the left shift", "<<"), ("the right shift", ">>"), ("whether equal", "=="),
    ("whether less", "<"), ("whether greater", ">"), ("the matrix product", "@"),
]  # fmt: skip
