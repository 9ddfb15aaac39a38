"""Retrieval in the BEIR layout for contrastive models, scored exactly as sentence-transformers'
`InformationRetrievalEvaluator` scores it.

A task directory holds `corpus.jsonl` ({"_id", "title", "text"}), `queries.jsonl` ({"_id", "text"}) and
`qrels/test.tsv` (header `query-id<TAB>corpus-id<TAB>score`; a score above 0 is relevant). Queries are embedded
by the query tower, documents (title and text joined by a space, the title left out when empty) by the passage
tower, each as training reads its side. Every query ranks the whole corpus by cosine similarity, ties going to
the lower corpus id (as the evaluator sorts its hits), and only queries with a relevant document are scored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pretraining.data.formats import padded
from pretraining.data.pair_format import TokenizedPairs
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.evals.task import gathered, share
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.contrastive import Contrastive

QRELS_HEADER = ["query-id", "corpus-id", "score"]
MRR_AT, NDCG_AT, MAP_AT = 10, 10, 100  # the evaluator's defaults


def read_jsonl(path: Path, keys: Sequence[str], optional: Sequence[str] = ()) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, record) of each non-blank line of `path`, a JSON object whose `keys` (and `optional` keys,
    when present) are strings; a missing file or a malformed line is refused naming it."""
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: build the suite with `pretrain-evals build` or fix the task's path")
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict) or not all(isinstance(record.get(key), str) for key in keys):
                raise ConfigError(f"{path}:{number}: must be a JSON object with the string fields {list(keys)}")
            if not all(isinstance(record[key], str) for key in optional if key in record):
                raise ConfigError(f"{path}:{number}: {list(optional)} must be strings where present")
            yield number, record


def unique_ids(path: Path, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, dict[str, str]]:
    """The records of a jsonl file by their `_id`, a repeated id refused naming its line."""
    records: dict[str, dict[str, str]] = {}
    for number, record in read_jsonl(path, ["_id", *keys], optional):
        if record["_id"] in records:
            raise ConfigError(f"{path}:{number}: _id {record['_id']!r} appears twice: ids must be unique")
        records[record["_id"]] = record
    return records


def read_qrels(path: Path, queries: dict[str, Any], corpus: dict[str, Any]) -> dict[str, set[str]]:
    """The relevant corpus ids of each query (score above 0), every id checked against the files it names."""
    if not path.is_file():
        raise MissingFileError(f"{path} is missing: build the suite with `pretrain-evals build` or fix the task's path")
    relevant: dict[str, set[str]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            row = line.rstrip("\r\n").split("\t")
            if number == 1:
                if row != QRELS_HEADER:
                    raise ConfigError(f"{path}:1: the header must be {chr(9).join(QRELS_HEADER)!r} (tab-separated)")
                continue
            if not line.strip():
                continue
            if len(row) != 3 or not row[2].strip().lstrip("-").isdigit():
                raise ConfigError(f"{path}:{number}: must be query-id, corpus-id and an integer score, tab-separated")
            query, document, score = row[0], row[1], int(row[2])
            for name, known, what in ((query, queries, "queries.jsonl"), (document, corpus, "corpus.jsonl")):
                if name not in known:
                    raise ConfigError(f"{path}:{number}: {name!r} is not an _id of {what}")
            if score > 0:
                relevant.setdefault(query, set()).add(document)
    if not relevant:
        raise ConfigError(f"{path} has no relevant pair (a score above 0): there is nothing to score")
    return relevant


@dataclass(frozen=True)
class RetrievalData:
    """A task's texts as token ids: the corpus in ascending id order (the evaluator breaks ties by id), the
    queries with a relevant document in file order, and the corpus indices relevant to each query."""

    corpus_ids: list[str]
    passages: list[list[int]]
    query_ids: list[str]
    queries: list[list[int]]
    relevant: list[list[int]]


def read_retrieval(directory: Path, data_format: TokenizedPairs, limit: int | None = None) -> RetrievalData:
    """The task in `directory` (BEIR layout), tokenised as `data_format` tokenises each side; `limit`: at most
    that many (scored) queries, the first, against the whole corpus."""
    corpus = unique_ids(directory / "corpus.jsonl", ["text"], ["title"])
    queries = unique_ids(directory / "queries.jsonl", ["text"])
    relevant = read_qrels(directory / "qrels" / "test.tsv", queries, corpus)
    corpus_ids = sorted(corpus)
    position = {corpus_id: index for index, corpus_id in enumerate(corpus_ids)}
    query_ids = [query for query in queries if query in relevant][:limit]
    return RetrievalData(
        corpus_ids,
        [data_format.encode_text(document_text(corpus[i]), data_format.passage_len) for i in corpus_ids],
        query_ids,
        [data_format.encode_text(queries[query]["text"], data_format.query_len) for query in query_ids],
        [sorted(position[document] for document in relevant[query]) for query in query_ids],
    )


def document_text(record: dict[str, str]) -> str:
    """A document as one text: its title and text joined by a space (BEIR's convention), the text alone
    without a title (unstripped: a passage is read as training reads one)."""
    return " ".join(part for part in (record.get("title", ""), record["text"]) if part)


def ranked(queries: torch.Tensor, corpus: torch.Tensor, depth: int, chunk: int = 4096) -> torch.Tensor:
    """The indices of the `depth` best corpus rows of each query by cosine similarity (sentence-transformers'
    `cos_sim`), best first, ties to the lower index, a non-finite score last; the similarity matrix is built
    `chunk` queries by `chunk` documents at a time."""
    queries, corpus = F.normalize(queries, p=2, dim=1), F.normalize(corpus, p=2, dim=1)
    parts = []
    for start in range(0, len(queries), chunk):
        block = queries[start : start + chunk]
        best_scores = block.new_empty(len(block), 0)
        best = torch.empty(len(block), 0, dtype=torch.long, device=block.device)
        for first in range(0, len(corpus), chunk):
            scores = block @ corpus[first : first + chunk].T
            scores = scores.masked_fill(~scores.isfinite(), float("-inf"))
            indices = torch.arange(first, first + scores.shape[1], device=block.device).expand_as(scores)
            # The kept best all have lower indices than this chunk: a stable sort keeps ties in index order.
            merged_scores, merged = torch.cat([best_scores, scores], 1), torch.cat([best, indices], 1)
            order = merged_scores.sort(dim=1, descending=True, stable=True).indices[:, :depth]
            best_scores, best = merged_scores.gather(1, order), merged.gather(1, order)
        parts.append(best)
    return torch.cat(parts)


def retrieval_metrics(
    queries: torch.Tensor, corpus: torch.Tensor, relevant: Sequence[Sequence[int]], k_values: Sequence[int]
) -> dict[str, float]:
    """nDCG@10, MRR@10, Recall@k, accuracy@1 and MAP@100 of `queries` ranking `corpus` (embeddings), query i's
    relevant rows being `relevant[i]` (none empty): InformationRetrievalEvaluator's formulas, binary relevance."""
    per_query = per_query_metrics(queries, corpus, relevant, k_values)
    return {name: values.mean().item() for name, values in per_query.items()}


def per_query_metrics(
    queries: torch.Tensor, corpus: torch.Tensor, relevant: Sequence[Sequence[int]], k_values: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Each query's terms of `retrieval_metrics` (their means), one tensor a metric."""
    depth = max(MRR_AT, NDCG_AT, MAP_AT, *k_values)
    top = ranked(queries, corpus, depth).cpu()
    hits = torch.zeros(len(top), depth, dtype=torch.float64)  # beyond a small corpus: no hit
    for row, (indices, wanted) in enumerate(zip(top.tolist(), map(set, relevant), strict=True)):
        hits[row, : len(indices)] = torch.tensor([float(index in wanted) for index in indices])
    counts = torch.tensor([len(wanted) for wanted in relevant], dtype=torch.float64)
    ranks = torch.arange(1, depth + 1, dtype=torch.float64)
    discounts = 1 / torch.log2(ranks + 1)
    ideal = discounts[:NDCG_AT].cumsum(0)[counts.clamp(max=NDCG_AT).long() - 1]  # every relevant one first
    found = hits[:, :MAP_AT].cumsum(1)
    return {
        f"ndcg@{NDCG_AT}": (hits[:, :NDCG_AT] * discounts[:NDCG_AT]).sum(1) / ideal,
        f"mrr@{MRR_AT}": (hits[:, :MRR_AT] / ranks[:MRR_AT]).amax(1),  # the first hit's reciprocal rank
        **{f"recall@{k}": hits[:, :k].sum(1) / counts for k in k_values},
        "accuracy@1": hits[:, 0],
        f"map@{MAP_AT}": (found / ranks[:MAP_AT] * hits[:, :MAP_AT]).sum(1) / counts.clamp(max=MAP_AT),
    }


class RetrievalTask:
    """A BEIR-layout retrieval task for `Contrastive` models: nDCG@10, MRR@10, Recall@k (`k_values`),
    accuracy@1 and MAP@100 over the first `limit` queries (all: None) with a relevant document."""

    def __init__(
        self,
        name: str,
        directory: Path,
        data_format: TokenizedPairs,
        batch_size: int = 64,
        limit: int | None = None,
        k_values: Sequence[int] = (1, 3, 5, 10),
    ) -> None:
        if batch_size < 1 or (limit is not None and limit < 1) or not k_values or min(k_values) < 1:
            raise ConfigError(
                f"eval task {name}: batch_size={batch_size}, limit={limit} and k_values={list(k_values)} must be "
                "positive (limit may be null: every query)"
            )
        self.name, self.directory, self.data_format = name, Path(directory), data_format
        self.batch_size, self.limit, self.k_values = batch_size, limit, tuple(k_values)

    @cached_property
    def data(self) -> RetrievalData:
        """The task's files, read and tokenised once."""
        return read_retrieval(self.directory, self.data_format, self.limit)

    def check(self, model: PretrainingObjective) -> None:
        """Refuse a model without query and passage towers, then read the task's files (refusing bad ones)."""
        if not isinstance(model, Contrastive):
            raise ConfigError(
                f"eval task {self.name} is a retrieval task, which scores Contrastive models, and this run trains "
                f"{type(model).__name__}: remove it from the evaluation's tasks"
            )
        self.data  # noqa: B018 (read now: a bad file stops the run before its first step)

    def evaluate(self, model: PretrainingObjective) -> dict[str, float]:
        return {name: values.mean().item() for name, values in self.per_query(model).items()}

    def per_query(self, model: PretrainingObjective) -> dict[str, torch.Tensor]:
        """Each scored query's terms of the metrics (`per_query_metrics`), one tensor a metric."""
        assert isinstance(model, Contrastive)
        data = self.data
        queries = self.embed(model, data.queries, "query", self.data_format.query_len)
        corpus = self.embed(model, data.passages, "passage", self.data_format.passage_len)
        return per_query_metrics(queries, corpus, data.relevant, self.k_values)

    @torch.no_grad()
    def embed(self, model: Contrastive, texts: list[list[int]], side: str, length: int) -> torch.Tensor:
        """Every text's embedding (each rank encodes its share, padded to `length` as in training), on this
        rank's device."""
        rows: list[torch.Tensor] = []
        for batch in share(texts, self.batch_size):
            tokens = torch.stack([padded(ids, length) for ids in batch]).to(model.device)
            rows.extend(model.encode(tokens, side).cpu().clone().unbind())  # rows of their own: each pickles alone
        return torch.stack(gathered(rows, len(texts))).to(model.device)
