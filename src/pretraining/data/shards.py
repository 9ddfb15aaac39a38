"""WebDataset tar shards and their manifest.

`build_shards` turns documents into `train-NNNNNN.tar` / `validation-NNNNNN.tar`
shards plus a `manifest.json` (per-shard samples, bytes, sha256; dataset
fields, sources, settings, dedup counts, split rule, the validation documents
left out as training text, provenance and a version hash). A sample holds one
tar member per text field (`<key>.txt`, or `<key>.query.txt` and
`<key>.passage.txt` for pairs) and `<key>.json` metadata. The whole
dataset is built in a staging directory and swapped in only when complete, so
a crash never leaves a half-written shard or manifest where a good one was.

`pretraining.data.manifest.Manifest` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pretraining.data.contamination import NGRAM, TrainingNgrams
from pretraining.data.corpus import Document, normalize
from pretraining.data.manifest import MANIFEST, SPLITS, TEXT_FIELDS
from pretraining.data.shard_writer import ShardWriter
from pretraining.data.staging import write_directory
from pretraining.errors import ShardError
from pretraining.files import write_atomically

FORMAT = "pretraining-shards/2"
SPLIT_RULE = "validation iff int(sha256(source_id)[:16], 16) / 2**64 < validation_fraction"
SOURCES_RULE = "validation iff the document was read from validation_sources"
TAIL_RULE = (
    "each document's last validation_tail of its characters, from the start of a line, is a validation document "
    "(source id + '#tail'); the rest of it is a training document"
)


@dataclass
class BuildSettings:
    """Everything that decides the bytes of the shards. The validation split is one of: a hash of each
    document's source id against `validation_fraction` (the default); the documents of
    `validation_sources`; or the last `validation_tail` of every document. A validation document with at
    least `decontaminate` of its 8-grams in the training split is left out (`pretraining.data.contamination`;
    None keeps every one)."""

    validation_fraction: float = 0.05
    max_shard_samples: int = 10_000
    max_shard_bytes: int = 1_000_000
    validation_sources: list[str] = field(default_factory=list)
    validation_tail: float | None = None
    decontaminate: float | None = 0.7

    def __post_init__(self) -> None:
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ShardError(f"validation_fraction={self.validation_fraction} must be in [0, 1)")
        if self.max_shard_samples < 1 or self.max_shard_bytes < 1:
            raise ShardError("max_shard_samples and max_shard_bytes must be positive")
        if self.validation_tail is not None and not 0.0 < self.validation_tail < 1.0:
            raise ShardError(f"--validation-tail {self.validation_tail} must be in (0, 1): the share of each document")
        if self.validation_sources and self.validation_tail is not None:
            raise ShardError("--validation-source and --validation-tail are two ways to choose validation: give one")
        if self.decontaminate is not None and not 0.0 < self.decontaminate <= 1.0:
            raise ShardError(
                f"--decontaminate {self.decontaminate} must be in (0, 1]: the share of a validation document's "
                f"8-grams found in training at which it is left out (--no-decontaminate keeps every one)"
            )
        if self.validation_sources or self.validation_tail is not None:
            self.validation_fraction = 0.0  # not used: the manifest says so

    @property
    def split_rule(self) -> str:
        if self.validation_sources:
            return SOURCES_RULE
        return SPLIT_RULE if self.validation_tail is None else TAIL_RULE


@dataclass
class BuildCounts:
    """What happened to the documents read."""

    read: int = 0
    undecodable: int = 0
    empty: int = 0
    exact_duplicates: int = 0
    contaminated: list[str] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))


def split_of(source_id: str, validation_fraction: float) -> str:
    """The split a document belongs to: a pure function of its source id."""
    position = int(hashlib.sha256(source_id.encode()).hexdigest()[:16], 16) / 2**64
    return "validation" if position < validation_fraction else "train"


def split_parts(document: Document, settings: BuildSettings, from_validation: bool) -> list[tuple[str, Document]]:
    """The (split, document) parts that a kept document becomes under the settings' split rule
    (`from_validation`: it was read from `validation_sources`)."""
    if settings.validation_sources:
        return [("validation" if from_validation else "train", document)]
    if settings.validation_tail is None:
        return [(split_of(document.source_id, settings.validation_fraction), document)]
    assert document.texts is not None and len(document.texts) == 1, "a tail is taken of single-text documents"
    ((name, text),) = document.texts.items()
    # The tail starts with the first line that starts at or after the cut, so no line is split.
    start = round(len(text) * (1 - settings.validation_tail))
    cut = text.find("\n", start - 1) + 1
    head, tail = normalize(text[:cut]), normalize(text[cut:])
    if not head or not tail:  # no line with text starts in its tail: it stays whole, in training
        return [("train", document)]
    return [
        ("train", Document(document.source_id, {name: head}, document.meta)),
        ("validation", Document(f"{document.source_id}#tail", {name: tail}, document.meta)),
    ]


def text_digests(texts: dict[str, str]) -> dict[str, str]:
    return {name: hashlib.sha256(text.encode()).hexdigest() for name, text in texts.items()}


def deduplicated(
    documents: Iterable[Document], counts: BuildCounts, seen: set[str] | None = None
) -> Iterator[tuple[Document, dict[str, str]]]:
    """Normalise; drop undecodable documents, those with an empty text, and those with any text
    seen before (in `seen` too, which it adds to); yield (document, sha256 of each text).

    For pairs a repeated query or passage is dropped too: two pairs sharing a text would be
    each other's false negatives in a contrastive batch."""
    seen = set() if seen is None else seen
    for document in documents:
        counts.read += 1
        if document.texts is None:
            counts.undecodable += 1
            continue
        texts = {name: normalize(text) for name, text in document.texts.items()}
        if not all(texts.values()):
            counts.empty += 1
            continue
        digests = text_digests(texts)
        if not seen.isdisjoint(digests.values()):
            counts.exact_duplicates += 1
            continue
        seen.update(digests.values())
        yield Document(document.source_id, texts, document.meta), digests


def build_shards(
    documents: Iterable[Document],
    out_dir: Path,
    sources: list[str],
    settings: BuildSettings | None = None,
    show_progress: bool = True,
    fields: tuple[str, ...] = TEXT_FIELDS,
    provenance: Callable[[], dict] | None = None,
    validation_documents: Iterable[Document] = (),
) -> dict:
    """Build train/validation shards and the manifest in `out_dir`; return the manifest.

    Every document must have exactly `fields`. `provenance`, called once the documents are
    consumed, adds what the readers counted (e.g. pair extraction) to the manifest.
    `validation_documents` (read from `settings.validation_sources`) are the validation split."""
    settings = settings or BuildSettings()

    def write(staging: Path) -> dict:
        return _write_dataset(
            documents, validation_documents, staging, sources, settings, show_progress, fields, provenance
        )

    return write_directory(out_dir, write)


def _write_dataset(
    documents: Iterable[Document],
    validation_documents: Iterable[Document],
    staging: Path,
    sources: list[str],
    settings: BuildSettings,
    show_progress: bool,
    fields: tuple[str, ...],
    provenance: Callable[[], dict] | None,
) -> dict:
    """Write shards and manifest into `staging`; return the manifest."""
    writers = {
        split: ShardWriter(staging, split, settings.max_shard_bytes, settings.max_shard_samples) for split in SPLITS
    }
    counts = BuildCounts()
    training = None if settings.decontaminate is None else TrainingNgrams()
    held: list[tuple[Document, dict[str, str]]] = []  # validation parts, judged once all training text is read

    def write(split: str, part: Document, digests: dict[str, str]) -> None:
        assert part.texts is not None
        meta = {"source_id": part.source_id, "sha256": digests, **part.meta}
        writers[split].write(f"{split}-{counts.kept[split]:09d}", part.texts, meta)
        counts.kept[split] += 1

    # A corpus's size is unknown until it is read: the display counts what has been done, and how fast.
    status = "building shards: {task.fields[read]:,} documents read, {task.completed:,} kept, {task.fields[mb]:,.1f} MB"
    columns = (SpinnerColumn(), TextColumn(status), TaskProgressColumn(show_speed=True), TimeElapsedColumn())
    with Progress(*columns, disable=not show_progress, transient=True) as progress:
        task = progress.add_task("build", total=None, read=0, mb=0.0)
        text_bytes = 0
        seen: set[str] = set()  # one deduplication over both: a validation text seen in training is dropped
        for from_validation, read in ((False, documents), (True, validation_documents)):
            for document, digests in deduplicated(read, counts, seen):
                assert document.texts is not None
                if tuple(document.texts) != fields:
                    raise ShardError(f"{document.source_id} has fields {tuple(document.texts)}, expected {fields}")
                for split, part in split_parts(document, settings, from_validation):
                    assert part.texts is not None
                    part_digests = digests if part is document else text_digests(part.texts)
                    if part is not document and not seen.isdisjoint(part_digests.values()):
                        counts.exact_duplicates += 1  # a head or tail that repeats a text kept before
                        continue
                    seen.update(part_digests.values())
                    if training is not None and split == "validation":
                        held.append((part, part_digests))
                        continue
                    write(split, part, part_digests)
                    if training is not None:
                        training.add(part.texts.values())
                text_bytes += sum(len(text) for text in document.texts.values())
                progress.update(task, advance=1, read=counts.read, mb=text_bytes / 1e6)
    for part, digests in held:
        assert training is not None and settings.decontaminate is not None and part.texts is not None
        if training.share(part.texts.values()) >= settings.decontaminate:
            counts.contaminated.append(part.source_id)
        else:
            write("validation", part, digests)
    shards = {split: writer.close() for split, writer in writers.items()}
    if counts.kept["train"] == 0:
        raise ShardError(
            f"no training documents in {sources} ({counts.read} read, {counts.empty} empty, "
            f"{counts.undecodable} not UTF-8, {counts.exact_duplicates} duplicates); point at a non-empty corpus, "
            f"or for a few documents hold out their ends for validation (--validation-tail 0.1)"
        )
    extra = {"provenance": provenance()} if provenance else {}
    manifest = _manifest(sources, settings, counts, shards, fields) | extra
    write_atomically(staging / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def _manifest(
    sources: list[str], settings: BuildSettings, counts: BuildCounts, shards: dict, fields: tuple[str, ...]
) -> dict:
    body: dict[str, Any] = {
        "format": FORMAT,
        "fields": list(fields),
        "sources": sources,
        "python": platform.python_version(),
        # The ways of choosing validation not used are left out.
        "settings": {key: value for key, value in asdict(settings).items() if value not in (None, [])},
        "split_rule": settings.split_rule,
        "normalization": "NFC, \\n newlines, trailing whitespace and leading blank lines stripped",
        "dedup": {
            "method": "exact sha256 of each normalised text field; a document repeating any text seen "
            "before in source order is dropped",
            "documents_read": counts.read,
            "undecodable_dropped": counts.undecodable,
            "empty_dropped": counts.empty,
            "exact_duplicates_dropped": counts.exact_duplicates,
        },
        "decontamination": {
            "rule": f"a validation document with at least {settings.decontaminate} of its distinct {NGRAM}-grams "
            "of words and punctuation marks in the training split is dropped"
            if settings.decontaminate is not None
            else "none: every validation document is kept",
            "dropped": counts.contaminated,
        },
        "splits": {
            split: {
                "documents": counts.kept[split],
                "text_bytes": sum(s.text_bytes for s in infos),
                "shards": [asdict(s) for s in infos],
            }
            for split, infos in shards.items()
        },
    }
    return {"version": dataset_version(body["fields"], body["splits"]), **body}


def dataset_version(fields: list[str], splits: dict) -> str:
    """The version names the data, not the build: same fields and shards, same version."""
    named = {"fields": fields, "splits": splits}
    return hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:16]
