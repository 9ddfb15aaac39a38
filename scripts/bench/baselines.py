"""The floors each pretraining objective must beat, on exactly the validation examples a run reports on.

    python scripts/bench/baselines.py clm [hydra overrides ...]           # experiment=clm_tiny unless one is given
    python scripts/bench/baselines.py mlm tokenizer=bpe data.dir=...      # experiment=mlm_tiny
    python scripts/bench/baselines.py contrastive                         # experiment=contrastive_tiny

The run's config is composed as `pretrain` composes it (configs/train.yaml and the overrides); the run's
tokenizer and DataModule are built from it, and the validation examples are the DataModule's
`validation_sets`, the examples the run validates on. Training statistics are counted on the training shards
the run reads, tokenised as its example format tokenises them. Each line names its metrics as the run logs them.

clm, scored as `CausalLM` scores validation: every block's token t+1 predicted from the tokens before it in its
block (`val/loss`: nats per token; `val/bpb`: the summed nats / (ln 2 * the UTF-8 bytes behind the targets),
comparable across tokenizers), by n-gram models of no parameter (nothing is tuned, on validation or anywhere else):
- unigram: the token frequencies, add-one smoothed over the tokenizer's vocabulary;
- 2-, 3- and 4-gram: the n-gram counts interpolated down to that unigram by Witten-Bell, each order with the one
  below it (a history of fewer tokens where the block holds fewer before the target, as a model sees it);
each counted twice: on the whole training split, and on the run's own training blocks, those its training loader
gives it from its first step to trainer.max_steps (max_steps x global batch blocks of block_size + 1 tokens), as a
model that memorised everything it read would.

mlm, on the objective's validation masks (`mask_tokens` at model.eval_mask_rate and model.eval_seed, as
`MaskedLM.masked_inputs` calls it), positions labelled IGNORE left out; `val/accuracy` over all selected
positions and `val/accuracy_{mask,random,kept}` at each kind (`selected_kinds`, as `MaskedLM` counts them):
- most frequent: always the most frequent non-special training token;
- copy: the visible input token where it is not `<mask>` (kept or randomly replaced), else the most frequent token;
- unigram: `val/loss`, nats per selected token, of the training frequencies of the non-special tokens, add-one
  smoothed.

contrastive, the validation pairs in sample_id order ranked by `Contrastive`'s own `retrieval_metrics` (with
model.recall_at and model.pool_size), queries to passages (q2p) and back (p2q):
- random: the mean metrics of 10 seeded random Gaussian embeddings (the expected MRR, H_N / N, alongside);
- bag of tokens: the cosine of the token-count vectors of the two sides (the ids the towers read, special
  tokens such as CLS and PAD left out);
- TF-IDF: those counts (raw tf, as scikit-learn's TfidfVectorizer by default) times the smoothed idf
  ln((1 + N) / (1 + df)) + 1 of the training split, where each training query and each passage is a document
  (N of them), L2-normalised; cosine;
- BM25 (k1 1.2, b 0.75), the candidates scored for each query: the query's token counts against
  idf(t) tf (k1 + 1) / (tf + k1 (1 - b + b |d| / mean |d|)) summed over its tokens, counted two ways: on the
  pool itself (its candidates' idf and mean length, as rank_bm25's BM25Okapi indexes them), and on the training
  split (Lucene's idf ln(1 + (N - df + 0.5) / (df + 0.5)) of TF-IDF's N documents, the mean length of the
  candidates' side), the stronger: a retriever has its training corpus, not its test pool, to count on.
With --checkpoint, a trained model's `val/q2p_mrr` and `val/p2q_mrr` on the same pairs (its own validation's
embeddings and ranks, over all the pairs: with data.val_size equal to model.pool_size, the pool), and its margin
over each floor with a 95 % paired-bootstrap interval: the queries drawn with replacement 2,000 times (seed 0),
the model's and the floor's reciprocal ranks of the same queries. A model is above a floor when the interval's
lower end is above zero.

    python scripts/bench/baselines.py contrastive --checkpoint logs/train/runs/<run>/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig

from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import PackedBlocks, encode_document
from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.reader import SampleReader
from pretraining.data.tokenizer import MASK_ID, SPECIAL_TOKENS
from pretraining.errors import ConfigError, PretrainingError
from pretraining.instantiate import build
from pretraining.objectives.contrastive import Contrastive, retrieval_metrics, retrieval_ranks
from pretraining.objectives.masked_lm import IGNORE, mask_tokens, selected_kinds
from pretraining.stored import load_checkpoint, stored_model

EXPERIMENTS = {"clm": "clm_tiny", "mlm": "mlm_tiny", "contrastive": "contrastive_tiny"}
FORMATS = {"clm": PackedBlocks, "mlm": PackedBlocks, "contrastive": TokenizedPairs}
# The model config keys each reads: a masked-LM's validation masks, a contrastive model's metrics.
MODEL_KEYS = {
    "clm": [],
    "mlm": ["eval_mask_rate", "eval_seed", "mask_prob", "random_prob"],
    "contrastive": ["recall_at", "pool_size"],
}
SPECIALS = len(SPECIAL_TOKENS)  # the first ids: never a masked label, never a token of a bag
RANDOM_DRAWS = 10
RESAMPLES = 2000  # of the paired bootstrap
MAX_ORDER = 4  # clm's n-gram floors: unigram to 4-gram
BM25_K1, BM25_B = 1.2, 0.75  # the usual defaults (Lucene's, rank_bm25's, bm25s')
Metrics = dict[str, float]
Floors = dict[str, Metrics]  # a floor's description -> its metrics, named as the run logs them
Embeddings = tuple[torch.Tensor, torch.Tensor]  # (queries, passages), row i of each from validation pair i
Ranked = dict[str, Embeddings]  # "q2p", "p2q" -> (what is searched with, what is searched), scored by dot product


def run_config(objective: str, overrides: Sequence[str]) -> DictConfig:
    """The root config `train` with `overrides`, after the objective's default experiment unless they name one."""
    if not any(override.startswith("experiment=") for override in overrides):
        overrides = [f"experiment={EXPERIMENTS[objective]}", *overrides]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run_data(cfg: DictConfig) -> ShardDataModule:
    """The run's DataModule, built with the run's tokenizer, as `pretraining.train.train` builds it (one shard
    directory: the floors are counted on one corpus)."""
    if cfg.data.get("sources") is not None:
        raise ConfigError("the floors are counted on one shard directory, and data.sources is a mixture: pass data.dir")
    return build(cfg.data, tokenizer=build(cfg.tokenizer))


def train_texts(data: ShardDataModule) -> Iterator[tuple[str, ...]]:
    """The texts of the format's fields of every training sample the run can read."""
    (source,) = data.sources
    urls = [source.manifest.url(s) for s in source.manifest.shards("train") if s.name not in source.refused]
    return SampleReader(data.format.fields, data.bad_data).all_texts(urls)


def train_tokens(data: ShardDataModule) -> np.ndarray:
    """The training documents tokenised as `PackedBlocks` tokenises them (each ending in EOS), as one stream."""
    documents = [np.asarray(encode_document(data.tokenizer, text), np.int64) for (text,) in train_texts(data)]
    return np.concatenate(documents)


def add_one(counts: np.ndarray) -> np.ndarray:
    return (counts + 1) / (counts + 1).sum()


@dataclass(frozen=True)
class Contexts:
    """What Witten-Bell needs of the k-grams of one order k >= 2, each coded as one integer in base `vocab`:
    the sorted distinct k-grams with their counts, and for each (k-1)-token context seen before a token,
    c(h), how many k-grams follow it, and T(h), how many distinct tokens do."""

    codes: np.ndarray
    counts: np.ndarray
    contexts: np.ndarray
    followers: np.ndarray  # c(h)
    types: np.ndarray  # T(h)


@dataclass(frozen=True)
class NGrams:
    """The n-gram counts of some training sequences, orders 1 to `order`."""

    vocab: int
    unigram: np.ndarray  # add-one smoothed over the vocabulary
    orders: dict[int, Contexts]  # k -> the counts of order k, for 2 <= k <= order


def count_ngrams(rows: np.ndarray, vocab: int, order: int) -> NGrams:
    """The k-grams, k <= `order`, inside each row of `rows` (sequences, none crossing into the next): a
    k-gram's code is the code of its first k-1 tokens times `vocab` plus its last token."""
    if vocab**order >= 2**63:
        raise SystemExit(f"a {order}-gram of a {vocab}-token vocabulary does not fit in an int64 code")
    unigram = add_one(np.bincount(rows.ravel(), minlength=vocab))
    orders, codes = {}, rows.astype(np.int64)
    for k in range(2, order + 1):
        codes = codes[:, :-1] * vocab + rows[:, k - 1 :]
        distinct, counts = np.unique(codes, return_counts=True)
        contexts, first, types = np.unique(distinct // vocab, return_index=True, return_counts=True)
        orders[k] = Contexts(distinct, counts, contexts, np.add.reduceat(counts, first), types)
    return NGrams(vocab, unigram, orders)


def looked_up(keys: np.ndarray, table: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The value of each key in the sorted `table` (its `values`), 0 where it is absent."""
    at = np.searchsorted(table, keys).clip(max=len(table) - 1)
    return np.where(table[at] == keys, values[at], 0)


def witten_bell(ngrams: NGrams, blocks: np.ndarray, order: int) -> np.ndarray:
    """P(blocks[:, t] | the order-1 tokens before it), for t >= 1, by interpolated Witten-Bell:
    (c(h, w) + T(h) P_lower(w)) / (c(h) + T(h)), P_lower the same one order down, down to the add-one unigram;
    P_lower itself where h was never seen, and where fewer than order-1 tokens of the block precede w (a model
    reading the block sees no more). No parameter: nothing is tuned, on validation or anywhere else."""
    if order == 1:
        return ngrams.unigram[blocks[:, 1:]]
    lower = witten_bell(ngrams, blocks, order - 1)
    counts, vocab = ngrams.orders[order], ngrams.vocab
    codes = np.zeros((len(blocks), blocks.shape[1] - order + 1), np.int64)
    for offset in range(order):  # the order-gram ending at each target with a whole history in its block
        codes = codes * vocab + blocks[:, offset : offset + codes.shape[1]]
    pair = looked_up(codes, counts.codes, counts.counts)
    followers = looked_up(codes // vocab, counts.contexts, counts.followers)
    types = looked_up(codes // vocab, counts.contexts, counts.types)
    tail = lower[:, order - 2 :]
    interpolated = (pair + types * tail) / np.maximum(followers + types, 1)
    return np.concatenate([lower[:, : order - 2], np.where(followers > 0, interpolated, tail)], axis=1)


def run_training_blocks(cfg: DictConfig, data: ShardDataModule) -> np.ndarray:
    """The blocks the run trains on, from its first step to its last (trainer.max_steps global batches), read
    from the run's own training loader as one device reads them (the number of devices changes nothing)."""
    micro_batches = cfg.trainer.max_steps * data.plan_for(1).accumulation
    loader = data.train_dataloader()
    return torch.cat([batch["tokens"] for batch in itertools.islice(loader, micro_batches)]).numpy()


def clm_floors(cfg: DictConfig, data: ShardDataModule) -> Floors:
    vocab = data.tokenizer.vocab_size
    blocks = torch.stack([example["tokens"] for example in data.validation_sets[0]]).numpy()
    target_bytes = sum(int(example["target_bytes"]) for example in data.validation_sets[0])
    run_blocks = run_training_blocks(cfg, data)
    sources = {
        "the whole training split": train_tokens(data)[None, :],
        f"the run's {run_blocks.shape[0]:,} training blocks ({run_blocks[:, 1:].size:,} targets)": run_blocks,
    }
    floors = {}
    for source, rows in sources.items():
        counted = time.perf_counter()
        ngrams = count_ngrams(rows, vocab, MAX_ORDER)
        seconds = time.perf_counter() - counted
        print(f"{source}: {rows.size:,} tokens counted to order {MAX_ORDER} in {seconds:.1f} s", file=sys.stderr)
        for order in range(1, MAX_ORDER + 1):
            name = "unigram, add-one" if order == 1 else f"{order}-gram, Witten-Bell"
            nll = -np.log(witten_bell(ngrams, blocks, order)).sum()
            floors[f"{name}, counted on {source}"] = {
                "val/loss": nll / blocks[:, 1:].size,
                "val/bpb": nll / (math.log(2) * target_bytes),
            }
    return floors


def mlm_floors(cfg: DictConfig, data: ShardDataModule) -> Floors:
    counts = np.bincount(train_tokens(data), minlength=data.tokenizer.vocab_size)[SPECIALS:]
    top = SPECIALS + int(counts.argmax())
    examples = data.validation_sets[0]
    inputs, positions, labels = mask_tokens(
        torch.stack([example["tokens"][:-1] for example in examples]),
        torch.stack([example["sample_id"] for example in examples]),
        cfg.model.eval_mask_rate,
        cfg.model.eval_seed,
        data.tokenizer.vocab_size,
        cfg.model.mask_prob,
        cfg.model.random_prob,
    )
    visible, counted = inputs.gather(1, positions), labels != IGNORE
    guesses = {
        f"most frequent token {data.tokenizer.decode([top])!r}": torch.full_like(labels, top),
        "copy the visible token, else the most frequent": torch.where(visible == MASK_ID, top, visible),
    }
    floors = {}
    for name, guess in guesses.items():
        correct = (guess == labels) & counted
        floors[name] = {"val/accuracy": float(correct.sum() / counted.sum())}
        for kind, selected in selected_kinds(visible, labels).items():
            if (selected & counted).any():
                floors[name][f"val/accuracy_{kind}"] = float((selected & correct).sum() / (selected & counted).sum())
    log_unigram = np.log(add_one(counts))
    floors["unigram, add-one smoothed"] = {"val/loss": -log_unigram[labels[counted].numpy() - SPECIALS].mean()}
    return floors


def token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) counts of the ids of each row, special tokens (CLS, PAD) left out."""
    counts = torch.zeros(len(ids), vocab_size, dtype=torch.float64).scatter_add_(1, ids, torch.ones_like(ids).double())
    counts[:, :SPECIALS] = 0
    return counts


@dataclass(frozen=True)
class TrainingStatistics:
    """The lexical floors' counts of the training split, where each training query and each passage is a
    document as the format encodes it: how many documents hold each token, and each side's mean length."""

    df: np.ndarray
    documents: int
    mean_length: dict[str, float]  # "query", "passage": non-special tokens


@functools.cache
def training_statistics(data: ShardDataModule) -> TrainingStatistics:
    """Cached: the floors and the margins of a checkpoint over them both read it, and it reads the whole split."""
    df, lengths = np.zeros(data.tokenizer.vocab_size), {"query": [], "passage": []}
    for pair in data.format.examples(train_texts(data)):
        for side, ids in (("query", pair.query), ("passage", pair.passage)):
            df[np.unique(ids)] += 1
            lengths[side].append(sum(token >= SPECIALS for token in ids))
    mean_length = {side: float(np.mean(counts)) for side, counts in lengths.items()}
    return TrainingStatistics(df, 2 * len(lengths["query"]), mean_length)


def bm25(queries: torch.Tensor, candidates: torch.Tensor, idf: torch.Tensor, mean_length: float) -> Embeddings:
    """Token counts turned into vectors whose dot product is BM25's score of each candidate for each query:
    the query's counts against idf(t) tf (k1 + 1) / (tf + k1 (1 - b + b |d| / mean_length)), each candidate's
    tf of each token t, |d| its length."""
    lengths = candidates.sum(1, keepdim=True)
    saturated = candidates * (BM25_K1 + 1) / (candidates + BM25_K1 * (1 - BM25_B + BM25_B * lengths / mean_length))
    return queries, saturated * idf


def pool_bm25(queries: torch.Tensor, candidates: torch.Tensor) -> Embeddings:
    """BM25 with the candidates' own statistics, as rank_bm25's BM25Okapi indexes them: idf
    ln((N - df + 0.5) / (df + 0.5)), one below zero (a token in more than half the candidates) replaced by
    0.25 x the mean idf of the tokens present."""
    df, present = (candidates > 0).sum(0).double(), candidates.sum(0) > 0
    idf = torch.log((len(candidates) - df + 0.5) / (df + 0.5))
    idf = torch.where(idf < 0, 0.25 * idf[present].mean(), idf)
    return bm25(queries, candidates, idf, float(candidates.sum(1).mean()))


def validation_pairs(data: ShardDataModule) -> list[dict[str, torch.Tensor]]:
    """The validation pairs in sample_id order, the order `Contrastive.validation_metrics` ranks them in."""
    return sorted(data.validation_sets[0], key=lambda example: int(example["sample_id"]))


def floor_embeddings(data: ShardDataModule) -> dict[str, list[Ranked]]:
    """Each floor's vectors of the validation pairs each way: one draw each, the random floor's `RANDOM_DRAWS`
    seeded Gaussian draws (no ties)."""
    examples = validation_pairs(data)
    vocab = data.tokenizer.vocab_size
    queries = token_counts(torch.stack([example["query"] for example in examples]), vocab)
    passages = token_counts(torch.stack([example["passage"] for example in examples]), vocab)
    statistics = training_statistics(data)
    df, documents = torch.from_numpy(statistics.df), statistics.documents
    tfidf = torch.log((1 + documents) / (1 + df)) + 1
    idf = torch.log(1 + (documents - df + 0.5) / (df + 0.5))  # Lucene's, never below zero
    pairs = len(examples)
    expected = sum(1 / rank for rank in range(1, pairs + 1)) / pairs
    draws = [torch.Generator().manual_seed(seed) for seed in range(RANDOM_DRAWS)]
    return {
        f"random, mean of {RANDOM_DRAWS} draws (expected mrr {expected:.4f})": [
            directions(*torch.randn(2, pairs, 64, generator=draw, dtype=torch.float64)) for draw in draws
        ],
        "bag of tokens, cosine": [directions(F.normalize(queries, dim=1), F.normalize(passages, dim=1))],
        "TF-IDF (raw tf, smoothed training idf), cosine": [
            directions(F.normalize(queries * tfidf, dim=1), F.normalize(passages * tfidf, dim=1))
        ],
        f"BM25 (k1 {BM25_K1}, b {BM25_B}), the pool's own idf and lengths": [
            {"q2p": pool_bm25(queries, passages), "p2q": pool_bm25(passages, queries)}
        ],
        f"BM25 (k1 {BM25_K1}, b {BM25_B}), training idf and lengths": [
            {
                "q2p": bm25(queries, passages, idf, statistics.mean_length["passage"]),
                "p2q": bm25(passages, queries, idf, statistics.mean_length["query"]),
            }
        ],
    }


def directions(queries: torch.Tensor, passages: torch.Tensor) -> Ranked:
    """A floor that embeds both sides alike: the same vectors each way."""
    return {"q2p": (queries, passages), "p2q": (passages, queries)}


def ranking(name: str, draws: list[Ranked], cfg: DictConfig) -> Floors:
    """`Contrastive.validation_metrics`' retrieval metrics of these embeddings, averaged over the draws: a floor
    each way."""
    floors = {}
    for direction in ("q2p", "p2q"):
        metrics = [
            retrieval_metrics(*draw[direction], tuple(cfg.model.recall_at), cfg.model.pool_size) for draw in draws
        ]
        floors[f"{name}, {direction}"] = {
            f"val/{direction}_{key}": float(np.mean([float(draw[key]) for draw in metrics])) for key in metrics[0]
        }
    return floors


def contrastive_floors(cfg: DictConfig, data: ShardDataModule) -> Floors:
    floors = {}
    for name, draws in floor_embeddings(data).items():
        floors |= ranking(name, draws, cfg)
    return floors


def reciprocal_ranks(draws: list[Ranked]) -> dict[str, np.ndarray]:
    """Each query's 1 / the rank of its own answer among all candidates, averaged over the draws, each way:
    the terms whose mean is `val/q2p_mrr` and `val/p2q_mrr` (`retrieval_ranks`, ties against the model)."""
    return {
        direction: np.mean([1 / retrieval_ranks(*draw[direction]).double().numpy() for draw in draws], 0)
        for direction in ("q2p", "p2q")
    }


def paired_bootstrap(
    model: np.ndarray, floor: np.ndarray, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float, float]:
    """The margin mean(model - floor) over the queries and its 95 % percentile interval: the queries drawn with
    replacement `resamples` times, the same draw for both (paired: a hard query is hard for both)."""
    differences = model - floor
    drawn = np.random.default_rng(seed).integers(0, len(differences), (resamples, len(differences)))
    low, high = np.quantile(differences[drawn].mean(1), [0.025, 0.975])
    return float(differences.mean()), float(low), float(high)


def model_embeddings(model: Contrastive, pairs: list[dict[str, torch.Tensor]], batch_size: int) -> Embeddings:
    """The embeddings `model` gives `pairs`, as its validation computes them (eval mode: no dropout)."""
    model.eval()
    with torch.no_grad():
        queries, passages = (
            torch.cat(
                [
                    model.encode(torch.stack([pair[side] for pair in pairs[start : start + batch_size]]), side)
                    for start in range(0, len(pairs), batch_size)
                ]
            )
            for side in ("query", "passage")
        )
    return queries, passages


def checkpoint_model(path: str, data: ShardDataModule) -> Contrastive:
    """The contrastive model of a checkpoint, refused unless it reads these pairs as they are made here."""
    try:
        model, _, examples = stored_model(load_checkpoint(path), path)
    except PretrainingError as error:
        raise SystemExit(f"baselines: {error}") from None
    if not isinstance(model, Contrastive):
        raise SystemExit(f"baselines: {path} holds a {type(model).__name__}, not a Contrastive model")
    if examples.tokenizer.fingerprint != data.tokenizer.fingerprint or examples.lengths != data.format.lengths:
        raise SystemExit(
            f"baselines: {path} was trained on pairs of {examples.lengths} tokens with tokenizer "
            f"{examples.tokenizer.fingerprint}, these are {data.format.lengths} with {data.tokenizer.fingerprint}: "
            f"pass the run's overrides (data.dir, tokenizer, data.format)"
        )
    return model


def checkpoint_margins(path: str, cfg: DictConfig, data: ShardDataModule) -> list[str]:
    """The checkpoint's MRR each way and its margin over each floor, with a 95 % paired-bootstrap interval."""
    model = checkpoint_model(path, data)
    batch_size = cfg.data.val_batch_size or cfg.data.global_batch_size
    ranks = reciprocal_ranks([directions(*model_embeddings(model, validation_pairs(data), batch_size))])
    lines = [
        f"{path}: " + "  ".join(f"val/{direction}_mrr={rr.mean():.4f}" for direction, rr in ranks.items()),
        f"  margins over the floors, 95 % paired bootstrap over the {len(ranks['q2p'])} queries "
        f"({RESAMPLES} resamples, seed 0):",
    ]
    for name, draws in floor_embeddings(data).items():
        for direction, floor in reciprocal_ranks(draws).items():
            margin, low, high = paired_bootstrap(ranks[direction], floor)
            verdict = "above" if low > 0 else "below" if high < 0 else "not distinguishable from"
            lines.append(f"    {name}, {direction}: {margin:+.4f} ({low:+.4f} to {high:+.4f}), {verdict} it")
    return lines


FLOORS = {"clm": clm_floors, "mlm": mlm_floors, "contrastive": contrastive_floors}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("objective", choices=FLOORS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run, as `pretrain` takes them")
    parser.add_argument(
        "--checkpoint",
        help="contrastive: a trained model's checkpoint; prints its MRR over the same pairs and its margin over "
        "each floor, with a 95 %% paired-bootstrap interval",
    )
    args = parser.parse_args(argv)
    if args.checkpoint and args.objective != "contrastive":
        parser.error("--checkpoint is for contrastive")
    start = time.perf_counter()
    try:
        cfg = run_config(args.objective, args.overrides)
        if missing := [f"model.{key}" for key in MODEL_KEYS[args.objective] if key not in cfg.model]:
            raise SystemExit(f"{args.objective} reads {', '.join(missing)}, which this run's model config lacks")
        data = run_data(cfg)
    except (PretrainingError, HydraException, OSError) as error:  # a bad override, data or tokenizer: no traceback
        raise SystemExit(f"baselines: {error}") from None
    if not isinstance(data.format, FORMATS[args.objective]):
        wanted, made = FORMATS[args.objective].__name__, type(data.format).__name__
        raise SystemExit(f"{args.objective} reads {wanted} examples, and this run's data config makes {made}")
    floors = FLOORS[args.objective](cfg, data)
    tokenizer = data.tokenizer
    print(
        f"{args.objective} floors on {len(data.validation_sets[0])} validation {data.format.kind} of {cfg.data.dir}, "
        f"{type(tokenizer).__name__} (vocabulary {tokenizer.vocab_size}), {time.perf_counter() - start:.1f} s:"
    )
    width = max(len(name) for name in floors)
    for name, metrics in floors.items():
        print(f"  {name:<{width}}  " + "  ".join(f"{metric}={value:.4f}" for metric, value in metrics.items()))
    if args.checkpoint:
        print("\n".join(checkpoint_margins(args.checkpoint, cfg, data)))


if __name__ == "__main__":
    main()
