"""The floor a language model must beat: bits per byte of a unigram model.

Byte-token frequencies are counted on the training shards (add-one smoothed)
and scored on exactly the validation blocks that a byte-tokenizer run reports
`val/bpb` on (same block size and number of blocks), with the same definition:
summed NLL of every next-token target / (ln 2 * target bytes).

    python scripts/unigram_bpb.py --data data/stdlib --block-size 256 --val-blocks 64
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from pretraining.data.shards import Manifest
from pretraining.data.stream import encode_sample, read_shard, validation_blocks
from pretraining.data.tokenizer import ByteTokenizer


def unigram_bpb(data: str, block_size: int, val_blocks: int) -> float:
    tokenizer = ByteTokenizer()
    manifest = Manifest.load(data)
    counts = np.ones(tokenizer.vocab_size)
    for url in manifest.urls("train"):
        for sample in read_shard(url):
            counts += np.bincount(encode_sample(tokenizer, sample), minlength=tokenizer.vocab_size)
    log_probs = np.log(counts / counts.sum())
    nll = target_bytes = 0.0
    for block in validation_blocks(manifest.urls("validation"), tokenizer, block_size, val_blocks):
        nll -= log_probs[block["tokens"][1:].numpy()].sum()
        target_bytes += int(block["target_bytes"])
    return nll / (math.log(2) * target_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--val-blocks", type=int, default=64)
    args = parser.parse_args()
    print(f"unigram byte model: {unigram_bpb(args.data, args.block_size, args.val_blocks):.4f} bits per byte")


if __name__ == "__main__":
    main()
