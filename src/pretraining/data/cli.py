"""`pretrain-data`: build shards from a corpus, train a BPE tokenizer on shards."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

from pretraining.data.corpus import CorpusError, read_source
from pretraining.data.shards import TOKENIZER, BuildSettings, Manifest, ShardError, build_shards
from pretraining.data.stream import read_shard
from pretraining.data.tokenizer import train_bpe


def build(args: argparse.Namespace) -> None:
    settings = BuildSettings(args.validation_fraction, args.shard_samples, args.shard_bytes)
    documents = itertools.chain.from_iterable(read_source(s, args.text_field) for s in args.source)
    manifest = build_shards(documents, Path(args.out), args.source, settings, show_progress=not args.quiet)
    dedup, splits = manifest["dedup"], manifest["splits"]
    if splits["validation"]["documents"] == 0:
        print("warning: no validation documents; training needs some: raise --validation-fraction")
    print(
        f"wrote {args.out}: version {manifest['version']}, "
        + ", ".join(f"{name} {s['documents']} docs in {len(s['shards'])} shards" for name, s in splits.items())
        + f"; dropped {dedup['exact_duplicates_dropped']} duplicates, {dedup['empty_dropped']} empty, "
        f"{dedup['undecodable_dropped']} not UTF-8"
    )


def train_texts(shard_dir: Path) -> Iterator[str]:
    for url in Manifest.load(shard_dir).urls("train"):
        for sample in read_shard(url):
            yield sample["txt"].decode("utf-8")


def tokenizer(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else Path(args.data) / TOKENIZER
    trained = train_bpe(train_texts(Path(args.data)), args.vocab_size, out)
    print(f"wrote {out}: vocabulary {trained.vocab_size}, fingerprint {trained.fingerprint}")


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="pretrain-data", description=__doc__)
    commands = main.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="build WebDataset shards and manifest.json from a corpus")
    b.add_argument("--source", action="append", default=None, help="'stdlib', a text directory or a .jsonl file")
    b.add_argument("--out", required=True, help="shard directory (replaced only when the build completes)")
    b.add_argument("--text-field", default="text", help="jsonl field holding the text")
    b.add_argument("--validation-fraction", type=float, default=BuildSettings.validation_fraction)
    b.add_argument("--shard-samples", type=int, default=BuildSettings.max_shard_samples)
    b.add_argument("--shard-bytes", type=int, default=BuildSettings.max_shard_bytes)
    b.add_argument("--quiet", action="store_true", help="no progress display")
    b.set_defaults(run=build)
    t = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer on the training shards")
    t.add_argument("--data", required=True, help="shard directory with manifest.json")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", help="tokenizer.json path (default: <data>/tokenizer.json)")
    t.set_defaults(run=tokenizer)
    return main


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "build" and not args.source:
        args.source = ["stdlib"]
    try:
        args.run(args)
    except (CorpusError, ShardError, FileNotFoundError, ValueError) as error:
        sys.exit(f"pretrain-data {args.command}: error: {error}")


if __name__ == "__main__":
    main()
