"""`pretrain-data`: build shards from a corpus, index shards you already have, train a BPE tokenizer on shards."""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from pretraining.data.corpus import (
    PAIR_FIELDS,
    TEXT_FIELDS,
    CorpusError,
    Document,
    PairCounts,
    docstring_pairs,
    is_record_source,
    read_source,
)
from pretraining.data.index import __doc__ as index_doc
from pretraining.data.index import index_shards, summary
from pretraining.data.manifest import TOKENIZER, Manifest
from pretraining.data.reader import SampleReader
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import train_bpe
from pretraining.errors import ShardError


def read_documents(source: str, args: argparse.Namespace, counts: PairCounts) -> Iterator[Document]:
    """Text documents, or with --pairs: pairs from two fields of records (jsonl, tables), or docstring
    pairs from Python source."""
    if not args.pairs:
        return read_source(source, {"txt": args.text_field}, args.id_field)
    fields = {"query.txt": args.query_field, "passage.txt": args.passage_field}
    documents = read_source(source, fields, args.id_field)
    return documents if is_record_source(source) else docstring_pairs(documents, counts)


def build(args: argparse.Namespace) -> None:
    settings = BuildSettings(args.validation_fraction, args.shard_samples, args.shard_bytes)
    counts = PairCounts()
    # Every source is opened (and checked) before the first shard is written.
    documents = itertools.chain.from_iterable([read_documents(s, args, counts) for s in args.source])
    manifest = build_shards(
        documents,
        Path(args.out),
        args.source,
        settings,
        show_progress=not args.quiet,
        fields=PAIR_FIELDS if args.pairs else TEXT_FIELDS,
        provenance=(lambda: {"docstring_pairs": asdict(counts)}) if args.pairs else None,
    )
    dedup, splits = manifest["dedup"], manifest["splits"]
    if splits["validation"]["documents"] == 0:
        print("warning: no validation documents; training needs some: raise --validation-fraction")
    print(
        f"wrote {args.out}: version {manifest['version']}, "
        + ", ".join(f"{name} {s['documents']} docs in {len(s['shards'])} shards" for name, s in splits.items())
        + f"; dropped {dedup['exact_duplicates_dropped']} duplicates, {dedup['empty_dropped']} empty, "
        f"{dedup['undecodable_dropped']} not UTF-8 (or a null in a table)"
    )
    if counts.files:
        print(f"docstring pairs: {asdict(counts)}")


def train_texts(manifest: Manifest, fields: list[str] | None = None) -> Iterator[str]:
    """Every text of `fields` (see `Manifest.text_fields`) of every training sample."""
    for texts in SampleReader(manifest.text_fields(fields)).all_texts(manifest.urls("train")):
        yield from texts


def tokenizer(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else Path(args.data) / TOKENIZER
    manifest = Manifest.load(args.data, trust_pipe_commands=args.trust_pipe_commands)
    texts = sum(shard.samples for shard in manifest.shards("train")) * len(manifest.text_fields(args.field))
    trained = train_bpe(train_texts(manifest, args.field), args.vocab_size, out, not args.quiet, length=texts)
    print(f"wrote {out}: vocabulary {trained.vocab_size}, fingerprint {trained.fingerprint}")


def index(args: argparse.Namespace) -> None:
    if not args.validation and args.validation_fraction is None:
        raise ShardError(
            "name the validation shards with --validation, or hold out a fraction of the training shards with "
            "--validation-fraction (0 for none)"
        )
    out = Path(args.out)
    manifest = index_shards(
        args.shards, out, args.validation, args.validation_fraction, args.remote_checksums, args.workers, not args.quiet
    )
    print("\n".join(summary(manifest, out.resolve())))


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="pretrain-data", description=__doc__)
    commands = main.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="build WebDataset shards and manifest.json from a corpus")
    b.add_argument(
        "--source",
        action="append",
        default=None,
        help="'stdlib' (default), a directory of text files, a .jsonl or .parquet file (or a directory of them), "
        "or a dataset saved by Hugging Face datasets' save_to_disk (one split); repeat to combine sources",
    )
    b.add_argument("--out", required=True, help="shard directory (replaced only when the build completes)")
    b.add_argument("--text-field", default="text", help="jsonl field or Parquet/dataset column holding the text")
    b.add_argument(
        "--id-field",
        default=None,
        help="jsonl field or column holding a stable document id, which decides its split "
        "(default: file name and line or row number; for a saved dataset, its directory name and row number)",
    )
    b.add_argument(
        "--pairs",
        action="store_true",
        help="build (query, passage) pairs for contrastive training: (docstring, code) from Python "
        "sources, or two jsonl fields or table columns",
    )
    b.add_argument("--query-field", default="query", help="jsonl field or column holding the query (with --pairs)")
    b.add_argument(
        "--passage-field", default="passage", help="jsonl field or column holding the passage (with --pairs)"
    )
    b.add_argument("--validation-fraction", type=float, default=BuildSettings.validation_fraction)
    b.add_argument("--shard-samples", type=int, default=BuildSettings.max_shard_samples)
    b.add_argument("--shard-bytes", type=int, default=BuildSettings.max_shard_bytes)
    b.add_argument("--quiet", action="store_true", help="no progress display")
    b.set_defaults(run=build)
    t = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer on the training shards")
    t.add_argument("--data", required=True, help="shard directory with manifest.json")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", help="tokenizer.json path (default: <data>/tokenizer.json)")
    t.add_argument("--field", action="append", help="a sample field to train on (default: txt, or a pair's sides)")
    t.add_argument("--trust-pipe-commands", action="store_true", help="run the pipe: commands the manifest names")
    t.add_argument("--quiet", action="store_true", help="no progress display")
    t.set_defaults(run=tokenizer)
    i = commands.add_parser(
        "index",
        help="write a manifest for WebDataset shards you already have (they stay where they are)",
        description=index_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("shards", nargs="+", help="training shards: files, directories, globs, brace lists, URLs, pipe:")
    i.add_argument("--validation", nargs="+", default=[], metavar="SHARDS", help="validation shards, named alike")
    i.add_argument("--validation-fraction", type=float, help="or hold out this fraction of the training shards")
    i.add_argument("--out", required=True, help="directory for manifest.json (may be the shards' own directory)")
    i.add_argument("--remote-checksums", action="store_true", help="record sha256 of remote shards too")
    i.add_argument("--workers", type=int, default=8, help="shards read at once")
    i.add_argument("--quiet", action="store_true", help="no progress display")
    i.set_defaults(run=index)
    return main


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "build" and not args.source:
        args.source = ["stdlib"]
    try:
        args.run(args)
    except (CorpusError, ShardError, OSError, ValueError) as error:
        sys.exit(f"pretrain-data {args.command}: error: {error}")


if __name__ == "__main__":
    main()
