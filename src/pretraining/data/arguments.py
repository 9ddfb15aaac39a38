"""`pretrain-data`'s arguments (`pretraining.cli.data` parses them, then runs `pretraining.data.commands`):
apart from the `pretrain` command's module, which a training run loads."""

from __future__ import annotations

import argparse

INDEX_DESCRIPTION = """\
Write a manifest for WebDataset shards that already exist; they stay where they are.

Shards are named as WebDataset names them: a local directory (its .tar, .tar.gz and .tgz files), a glob,
a brace list (train-{000000..000099}.tar), a URL or a pipe: command. Each shard is read once, whole: its
samples are counted (a damaged shard is refused, naming it), the fields of every sample are recorded, and
so are its size and sha256 (for remote shards only with --remote-checksums). Training runs the pipe:
commands a manifest names only when told to trust them (data.trust_pipe_commands=true).
"""


def data_parser() -> argparse.ArgumentParser:
    """`pretrain-data`'s arguments; each subcommand is the function of `pretraining.data.commands` it names."""
    main = argparse.ArgumentParser(
        prog="pretrain-data",
        description="Build shards from a corpus, index shards you already have, train a BPE tokenizer on shards, "
        "mine hard negatives into pair shards.",
    )
    commands = main.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="build WebDataset shards and manifest.json from a corpus")
    b.add_argument(
        "--source",
        action="append",
        default=None,
        help="'stdlib' (default), a text file or a directory of text files, a .jsonl or .parquet file (or a "
        "directory of them), or a dataset saved by Hugging Face datasets' save_to_disk (one split); repeat to "
        "combine sources",
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
    # Left out when not given: pretraining.data.shards.BuildSettings holds the defaults.
    b.add_argument(
        "--validation-fraction",
        type=float,
        default=argparse.SUPPRESS,
        help="the share of documents held out for validation, by a hash of each one's id (default 0.05)",
    )
    b.add_argument(
        "--validation-source",
        action="append",
        default=argparse.SUPPRESS,
        dest="validation_sources",
        help="a source (as --source) whose documents are the validation split, all others training; repeat for more",
    )
    b.add_argument(
        "--validation-tail",
        type=float,
        default=argparse.SUPPRESS,
        help="or hold out the last FRACTION of every document (from a line start) for validation, the rest training",
    )
    b.add_argument(
        "--decontaminate",
        type=float,
        default=argparse.SUPPRESS,
        metavar="SHARE",
        help="leave out a validation document when this share of its 8-grams is in the training split (default 0.7)",
    )
    b.add_argument(
        "--no-decontaminate",
        action="store_const",
        const=None,
        default=argparse.SUPPRESS,
        dest="decontaminate",
        help="keep every validation document, however much of it the training split holds",
    )
    b.add_argument("--shard-samples", type=int, default=argparse.SUPPRESS, dest="max_shard_samples")
    b.add_argument("--shard-bytes", type=int, default=argparse.SUPPRESS, dest="max_shard_bytes")
    b.add_argument("--quiet", action="store_true", help="no progress display")
    t = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer on the training shards")
    t.add_argument("--data", required=True, help="shard directory with manifest.json")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--out", help="tokenizer.json path (default: <data>/tokenizer.json)")
    t.add_argument("--field", action="append", help="a sample field to train on (default: txt, or a pair's sides)")
    t.add_argument("--trust-pipe-commands", action="store_true", help="run the pipe: commands the manifest names")
    t.add_argument("--quiet", action="store_true", help="no progress display")
    i = commands.add_parser(
        "index",
        help="write a manifest for WebDataset shards you already have (they stay where they are)",
        description=INDEX_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    i.add_argument("shards", nargs="+", help="training shards: files, directories, globs, brace lists, URLs, pipe:")
    i.add_argument("--validation", nargs="+", default=[], metavar="SHARDS", help="validation shards, named alike")
    i.add_argument("--validation-fraction", type=float, help="or hold out this fraction of the training shards")
    i.add_argument("--out", required=True, help="directory for manifest.json (may be the shards' own directory)")
    i.add_argument("--remote-checksums", action="store_true", help="record sha256 of remote shards too")
    i.add_argument("--workers", type=int, default=8, help="shards read at once")
    i.add_argument("--quiet", action="store_true", help="no progress display")
    n = commands.add_parser(
        "negatives",
        help="a copy of pair shards where every pair carries the training passages BM25 ranks best for its query, "
        "as hard negatives (data.format.hard_negatives reads them)",
    )
    n.add_argument("--data", required=True, help="pair shard directory with manifest.json")
    n.add_argument("--count", type=int, default=7, help="negatives per pair (default 7, as nomic-embed's)")
    n.add_argument("--out", required=True, help="the new shard directory (replaced only when it is complete)")
    n.add_argument("--trust-pipe-commands", action="store_true", help="run the pipe: commands the manifest names")
    return main
