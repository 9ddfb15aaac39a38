"""What `pretrain-data build|tokenizer|index|negatives` do, with the arguments `pretraining.data.arguments.data_parser`
parsed."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from pretraining.data.corpus import Document, is_record_source, read_source
from pretraining.data.index import index_shards, summary, training_command
from pretraining.data.manifest import PAIR_FIELDS, TEXT_FIELDS, TOKENIZER, Manifest
from pretraining.data.negatives import mine_negatives
from pretraining.data.pairs import PairCounts, docstring_pairs
from pretraining.data.reader import SampleReader
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import train_bpe
from pretraining.data.validation import DEVICE_MULTIPLE
from pretraining.errors import ShardError


def read_documents(source: str, args: argparse.Namespace, counts: PairCounts) -> Iterator[Document]:
    """Text documents, or with --pairs: pairs from two fields of records (jsonl, tables), or docstring
    pairs from Python source."""
    if not args.pairs:
        return read_source(source, {"txt": args.text_field}, args.id_field)
    fields = {"query.txt": args.query_field, "passage.txt": args.passage_field}
    documents = read_source(source, fields, args.id_field)
    return documents if is_record_source(source) else docstring_pairs(documents, counts)


# How `pretrain-data build` may choose the validation split: the flag, and its key in BuildSettings.
VALIDATION_FLAGS = {
    "--validation-fraction": "validation_fraction",
    "--validation-source": "validation_sources",
    "--validation-tail": "validation_tail",
}


def build_settings(args: argparse.Namespace) -> BuildSettings:
    """The settings given (those not given are absent from `args`: BuildSettings has their defaults), with
    one way of choosing validation."""
    given = vars(args)
    explicit = [flag for flag, key in VALIDATION_FLAGS.items() if key in given]
    if len(explicit) > 1:
        raise ShardError(f"{' and '.join(explicit)} are ways to choose the validation split: give one")
    if args.pairs and "validation_tail" in given:
        raise ShardError("--validation-tail cuts the text of documents, not pairs: use --validation-source")
    names = [field.name for field in dataclasses.fields(BuildSettings)]
    return BuildSettings(**{name: given[name] for name in names if name in given})


def build(args: argparse.Namespace) -> None:
    args.source = args.source or ["stdlib"]
    settings = build_settings(args)
    counts = PairCounts()
    # Every source is opened (and checked) before the first shard is written.
    documents = itertools.chain.from_iterable([read_documents(s, args, counts) for s in args.source])
    validation = [read_documents(s, args, counts) for s in settings.validation_sources]
    manifest = build_shards(
        documents,
        Path(args.out),
        args.source,
        settings,
        show_progress=not args.quiet,
        fields=PAIR_FIELDS if args.pairs else TEXT_FIELDS,
        provenance=(lambda: {"docstring_pairs": asdict(counts)}) if args.pairs else None,
        validation_documents=itertools.chain.from_iterable(validation),
    )
    dedup, splits = manifest["dedup"], manifest["splits"]
    print(
        f"wrote {args.out}: version {manifest['version']}, "
        + ", ".join(f"{name} {s['documents']} docs in {len(s['shards'])} shards" for name, s in splits.items())
        + f"; dropped {dedup['exact_duplicates_dropped']} duplicates, {dedup['empty_dropped']} empty, "
        f"{dedup['undecodable_dropped']} not UTF-8 (or a null in a table), "
        + (
            f"{len(manifest['decontamination']['dropped'])} validation documents mostly in the training split"
            if settings.decontaminate is not None
            else "no validation document for being training text (--no-decontaminate)"
        )
    )
    if counts.files:
        print(f"docstring pairs: {asdict(counts)}")
    warning = small_validation_warning(
        splits["validation"]["documents"], args.pairs, len(manifest["decontamination"]["dropped"])
    )
    if warning:
        print(warning)
    print(training_command(manifest, Path(args.out).resolve()))


def small_validation_warning(documents: int, pairs: bool, contaminated: int = 0) -> str | None:
    """A warning line for a validation split of fewer documents than the examples a run keeps to share them
    alike on up to `DEVICE_MULTIPLE` devices (one example per device is the least it accepts): found at build
    time, not at the first validation. `contaminated`: the validation documents left out as training text."""
    if documents >= DEVICE_MULTIPLE:
        return None
    flags = "--validation-fraction" if pairs else "--validation-fraction or --validation-tail"
    left_out = (
        f" (and {contaminated} left out as mostly training text: the manifest's decontamination names them)"
        if contaminated
        else ""
    )
    return (
        f"warning: the validation split has {documents} documents{left_out}, fewer than the {DEVICE_MULTIPLE} "
        f"validation examples a run shares alike on up to {DEVICE_MULTIPLE} devices (training refuses fewer than "
        f"one per device{'; a pair is one example' if pairs else ''}): raise {flags}, or give a larger "
        f"--validation-source" + (", or keep more with a higher --decontaminate" if contaminated else "")
    )


def text_fields(manifest: Manifest, named: list[str] | None = None) -> tuple[str, ...]:
    """The fields to read texts from: those `named` (a tokenizer's `--field`s), else those of built shards
    (a text, or both sides of a pair)."""
    if named:
        manifest.require_fields([("--field", name) for name in named], "name one of those")
        return tuple(named)
    for fields in (TEXT_FIELDS, PAIR_FIELDS):
        if set(fields) <= set(manifest.fields):
            return fields
    raise ShardError(
        f"{manifest.directory}'s samples have no txt field (they have {', '.join(manifest.fields)}): name the text "
        f"field(s) with --field, as in data.format.text_field"
    )


def train_texts(manifest: Manifest, fields: list[str] | None = None) -> Iterator[str]:
    """Every text of `fields` (see `text_fields`) of every training sample."""
    for texts in SampleReader(text_fields(manifest, fields)).all_texts(manifest.urls("train")):
        yield from texts


def tokenizer(args: argparse.Namespace) -> None:
    out = Path(args.out) if args.out else Path(args.data) / TOKENIZER
    manifest = Manifest.load(
        args.data, key="--data", trust_pipe_commands=args.trust_pipe_commands, trust_option="--trust-pipe-commands"
    )
    texts = sum(shard.samples for shard in manifest.shards("train")) * len(text_fields(manifest, args.field))
    trained = train_bpe(train_texts(manifest, args.field), args.vocab_size, out, not args.quiet, length=texts)
    print(f"wrote {out}: vocabulary {trained.vocab_size}, fingerprint {trained.fingerprint}")


def negatives(args: argparse.Namespace) -> None:
    manifest = mine_negatives(args.data, args.out, args.count, args.trust_pipe_commands)
    documents = ", ".join(f"{name} {split['documents']}" for name, split in manifest["splits"].items())
    print(f"wrote {args.out}: version {manifest['version']}, {args.count} negatives for each pair ({documents})")
    out = Path(args.out).resolve()
    print(f"train on it: pretrain data=pairs data.dir={out} data.format.hard_negatives={args.count}")


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
