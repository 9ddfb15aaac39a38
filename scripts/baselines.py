"""The floors each objective must beat, on exactly the validation data a run reports on.

    python scripts/baselines.py clm --data data/stdlib                 # unigram bits per byte
    python scripts/baselines.py mlm --data data/stdlib                 # most-frequent-token accuracy
    python scripts/baselines.py contrastive --data data/stdlib_pairs   # retrieval by chance

clm: byte frequencies counted on the training shards (add-one smoothed), scored on the
validation blocks with the run's definition of `val/bpb`. mlm: always predicting the most
frequent training token, scored on the validation blocks masked as MaskedLM masks them at
its evaluation rate and seed (`val/accuracy`), and the unigram loss on those positions
(`val/loss`). contrastive: MRR and Recall@k of a random ranking of the validation pairs.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from pretraining.data.formats import PackedBlocks, encode_document
from pretraining.data.manifest import Manifest
from pretraining.data.reader import SampleReader
from pretraining.data.stream import validation_examples
from pretraining.data.tokenizer import SPECIAL_TOKENS, ByteTokenizer
from pretraining.objectives.masked_lm import IGNORE, mask_tokens


def train_token_counts(manifest: Manifest, tokenizer: ByteTokenizer) -> np.ndarray:
    counts = np.ones(tokenizer.vocab_size)
    for (text,) in SampleReader(manifest.text_fields()[:1]).all_texts(manifest.urls("train")):
        counts += np.bincount(encode_document(tokenizer, text), minlength=tokenizer.vocab_size)
    return counts


def validation_tokens(manifest: Manifest, tokenizer: ByteTokenizer, block_size: int, val_size: int) -> list[dict]:
    return validation_examples(manifest.urls("validation"), PackedBlocks(tokenizer, block_size), val_size)


def clm(args: argparse.Namespace) -> None:
    tokenizer, manifest = ByteTokenizer(), Manifest.load(args.data)
    counts = train_token_counts(manifest, tokenizer)
    log_probs = np.log(counts / counts.sum())
    nll = target_bytes = 0.0
    for block in validation_tokens(manifest, tokenizer, args.block_size, args.val_size):
        nll -= log_probs[block["tokens"][1:].numpy()].sum()
        target_bytes += int(block["target_bytes"])
    print(f"unigram byte model: {nll / (math.log(2) * target_bytes):.4f} bits per byte (val/bpb)")


def mlm(args: argparse.Namespace) -> None:
    tokenizer, manifest = ByteTokenizer(), Manifest.load(args.data)
    counts = train_token_counts(manifest, tokenizer)[len(SPECIAL_TOKENS) :]  # specials are never masked
    log_probs = np.log(counts / counts.sum())
    blocks = validation_tokens(manifest, tokenizer, args.block_size, args.val_size)
    tokens = torch.stack([block["tokens"][:-1] for block in blocks])
    ids = torch.stack([block["sample_id"] for block in blocks])
    _, _, labels = mask_tokens(tokens, ids, args.rate, args.seed, tokenizer.vocab_size)
    labels = labels[labels != IGNORE].numpy() - len(SPECIAL_TOKENS)
    top = int(counts.argmax())
    accuracy = np.mean(labels == top)
    token = tokenizer.decode([top + len(SPECIAL_TOKENS)])
    print(f"most frequent training token {token!r}: accuracy {accuracy:.4f} (val/accuracy)")
    print(f"unigram model: loss {-log_probs[labels].mean():.4f} nats per masked token (val/loss)")


def contrastive(args: argparse.Namespace) -> None:
    manifest = Manifest.load(args.data)
    pairs = min(args.val_size, sum(shard.samples for shard in manifest.shards("validation")))
    harmonic = sum(1 / rank for rank in range(1, pairs + 1))
    recalls = ", ".join(f"Recall@{k} {k / pairs:.4f}" for k in (1, 5, 10))
    print(f"random ranking of {pairs} validation pairs: MRR {harmonic / pairs:.4f} (1/N = {1 / pairs:.4f}), {recalls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    objectives = parser.add_subparsers(dest="objective", required=True)
    commands = {}
    for name, run, data, val_size in [
        ("clm", clm, "data/stdlib", 64),
        ("mlm", mlm, "data/stdlib", 64),
        ("contrastive", contrastive, "data/stdlib_pairs", 1000),
    ]:
        commands[name] = objectives.add_parser(name)
        commands[name].add_argument("--data", default=data)
        commands[name].add_argument("--val-size", type=int, default=val_size, help="data.val_size of the run")
        commands[name].set_defaults(run=run)
    for name in ("clm", "mlm"):
        commands[name].add_argument("--block-size", type=int, default=256, help="data.format.block_size of the run")
    commands["mlm"].add_argument("--rate", type=float, default=0.15, help="model.eval_mask_rate of the run")
    commands["mlm"].add_argument("--seed", type=int, default=0, help="model.eval_seed of the run")
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
