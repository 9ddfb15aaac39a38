"""Hard negatives for contrastive training, mined by BM25 into a new pair dataset (`pretrain-data negatives`).

Every pair, of both splits, gets the `count` training passages that BM25 ranks highest for its query as fields
`negative1.txt` ... (best first); the pair's own passage and every training pair sharing its query or passage
text are left out (a duplicate would be a false negative). `data.format.hard_negatives=N` reads the first N.
Mined once, before training, into the shards: a run streams each pair's negatives with it, so its data position
resumes them exactly, and the dataset's version names them (a function of the pairs alone: no seed).

BM25 (k1 1.2, b 0.75, Lucene's idf) over the lower-cased words and numbers of the training passages; ties go to
the earlier passage. Scores are a dense (passages x queries) matrix, a chunk of queries at a time: mining is
quadratic in the pairs (seconds at 10^4 pairs, hours at 10^6; mine a sample of the corpus, or shard it).
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from pretraining.data.manifest import MANIFEST, PAIR_FIELDS, SPLITS, TOKENIZER, Manifest, negative_fields
from pretraining.data.reader import SampleReader
from pretraining.data.shard_writer import ShardWriter
from pretraining.data.shards import FORMAT, BuildSettings, dataset_version, text_digests
from pretraining.data.staging import write_directory
from pretraining.errors import ShardError

K1, B = 1.2, 0.75
WORDS = re.compile(r"[a-z]+|[0-9]+")
SCORES_PER_CHUNK = 2**24  # floats of one chunk of queries' scores (passages x queries) and counts (words x queries)


def word_counts(text: str) -> Counter[str]:
    return Counter(WORDS.findall(text.lower()))


class PassageIndex:
    """BM25 weights of the training passages: a (passages x words) sparse matrix whose product with a query's
    word counts is each passage's score."""

    def __init__(self, passages: Sequence[str]) -> None:
        bags = [word_counts(passage) for passage in passages]
        self.words = {word: column for column, word in enumerate(sorted(set().union(*bags)))}
        rows = [row for row, bag in enumerate(bags) for _ in bag]
        columns = [self.words[word] for bag in bags for word in bag]
        tf = torch.tensor([count for bag in bags for count in bag.values()], dtype=torch.float32)
        lengths = torch.tensor([bag.total() for bag in bags], dtype=torch.float32)
        df = torch.bincount(torch.tensor(columns, dtype=torch.long), minlength=len(self.words)).float()
        idf = torch.log(1 + (len(bags) - df + 0.5) / (df + 0.5))
        norm = K1 * (1 - B + B * lengths / lengths.mean().clamp(min=1))
        weights = idf[columns] * tf * (K1 + 1) / (tf + norm[rows])
        indices = torch.tensor([rows, columns], dtype=torch.long).reshape(2, -1)
        shape = (len(bags), len(self.words))
        self.weights = torch.sparse_coo_tensor(indices, weights, shape, check_invariants=True).coalesce()

    def scores(self, queries: Sequence[str]) -> torch.Tensor:
        """(passages, len(queries)) BM25 scores; a word no passage has counts for nothing."""
        counts = torch.zeros(len(self.words), len(queries))
        for column, query in enumerate(queries):
            for word, count in word_counts(query).items():
                if word in self.words:
                    counts[self.words[word], column] = count
        return torch.sparse.mm(self.weights, counts)


def best(scores: torch.Tensor, count: int) -> list[int]:
    """The `count` highest-scoring rows, best first, a tie to the lower row (whatever order topk gives); fewer
    where fewer are not left out (-inf)."""
    count = min(count, int(scores.isfinite().sum()))
    if count == 0:
        return []
    threshold = scores.topk(count).values[-1]
    chosen = (scores > threshold).nonzero().flatten().tolist()
    chosen += (scores == threshold).nonzero().flatten().tolist()[: count - len(chosen)]
    return sorted(chosen, key=lambda row: (-float(scores[row]), row))


def mine(pairs: Sequence[tuple[str, str]], training: Sequence[tuple[str, str]], count: int) -> list[list[int]]:
    """For each (query, passage) of `pairs`, the indices of its `count` negatives among the `training` pairs'
    passages: BM25's best for the query but for the pairs sharing its query or its passage."""
    index = PassageIndex([passage for _, passage in training])
    sharing: defaultdict[str, list[int]] = defaultdict(list)
    for row, (query, passage) in enumerate(training):
        sharing["q" + query].append(row)
        sharing["p" + passage].append(row)
    chunk = max(1, SCORES_PER_CHUNK // max(len(training), len(index.words)))  # the scores' and the counts' floats
    mined = []
    for start in range(0, len(pairs), chunk):
        batch = pairs[start : start + chunk]
        scores = index.scores([query for query, _ in batch])
        for column, (query, passage) in enumerate(batch):
            column_scores = scores[:, column].clone()
            column_scores[sharing["q" + query] + sharing["p" + passage]] = float("-inf")
            mined.append(best(column_scores, count))
            if len(mined[-1]) < count:
                raise ShardError(
                    f"the pair {query[:60]!r} shares its texts with all but {len(mined[-1])} training pairs: too "
                    f"few for {count} negatives; mine fewer (--count)"
                )
    return mined


def mine_negatives(data: str, out: str, count: int, trust_pipe_commands: bool = False) -> dict:
    """Write `data`'s pairs with `count` mined negatives each into `out` (replaced only once it is complete);
    return the new manifest."""
    if count < 1:
        raise ShardError(f"--count={count}: mine at least one negative per pair")
    manifest = Manifest.load(
        data, key="--data", trust_pipe_commands=trust_pipe_commands, trust_option="--trust-pipe-commands"
    )
    if Path(out).resolve() == manifest.directory:
        raise ShardError(f"--out={out} is --data itself: write the pairs with negatives to a new directory")
    manifest.require_fields(
        [("--data", field) for field in PAIR_FIELDS], "`pretrain-data negatives` mines pair shards (`build --pairs`)"
    )
    # Built shards give each sample's record (source id, name, kind: what the probe labels) to carry on.
    raw = json.loads((manifest.directory / MANIFEST).read_text())
    fields = (*PAIR_FIELDS, *(() if raw.get("indexed") else ("json",)))
    reader = SampleReader(fields, "raise")
    samples = {split: list(reader.all_texts(manifest.urls(split))) for split in SPLITS}
    pairs = {split: [(query, passage) for query, passage, *_ in samples[split]] for split in SPLITS}
    training = pairs["train"]
    if len(training) <= count:
        raise ShardError(f"{data} has {len(training)} training pairs: too few for {count} negatives each, and others")
    every = mine(pairs["train"] + pairs["validation"], training, count)  # one index of the passages for both
    negatives = {"train": every[: len(training)], "validation": every[len(training) :]}
    mined = {"from": str(manifest.directory), "version": manifest.version, "count": count, "k1": K1, "b": B}

    def write(staging: Path) -> dict:
        splits = {split: write_split(staging, split, samples[split], negatives[split], training) for split in SPLITS}
        names = [*PAIR_FIELDS, *negative_fields(count)]
        new = {"version": dataset_version(names, splits), "format": FORMAT, "fields": names, "splits": splits}
        copied = ("sources", "split_rule", "decontamination")
        new |= {key: raw[key] for key in copied if key in raw} | {"hard_negatives": mined}
        (staging / MANIFEST).write_text(json.dumps(new, indent=2) + "\n")
        if (manifest.directory / TOKENIZER).is_file():  # a run reads ${data.dir}/tokenizer.json
            shutil.copy2(manifest.directory / TOKENIZER, staging / TOKENIZER)
        return new

    return write_directory(Path(out), write, keep_tokenizer=False)


def write_split(
    staging: Path,
    split: str,
    samples: Sequence[tuple[str, ...]],
    negatives: Sequence[list[int]],
    training: Sequence[tuple[str, str]],
) -> dict:
    """Write one split's pairs (each with its JSON record, from built shards) and their `negatives` (rows of
    `training`) as shards into `staging`; its entry in the manifest."""
    settings = BuildSettings()
    writer = ShardWriter(staging, split, settings.max_shard_bytes, settings.max_shard_samples)
    for number, (sample, rows) in enumerate(zip(samples, negatives, strict=True)):
        fields = (*PAIR_FIELDS, *negative_fields(len(rows)))
        texts = dict(zip(fields, (*sample[:2], *(training[row][1] for row in rows)), strict=True))
        record = json.loads(sample[2]) if len(sample) > 2 else {}
        writer.write(f"{split}-{number:09d}", texts, record | {"sha256": text_digests(texts)})
    shards = writer.close()
    text_bytes = sum(shard.text_bytes or 0 for shard in shards)
    return {"documents": len(samples), "text_bytes": text_bytes, "shards": [asdict(shard) for shard in shards]}
