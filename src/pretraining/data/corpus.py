"""Corpus readers: each turns a source into `Document`s with a stable source id.

A source is named by a string: `stdlib` (the Python standard library's own
source, present wherever Python is), a directory of text files, a `.jsonl`
file (or a directory of them) with a text field, or a table with a text column:
a `.parquet` file (or a directory of them) or a dataset saved by Hugging Face
`datasets` (`save_to_disk`), both read in `tables`. Adding a corpus means adding
one reader (here, or in a module of its own) and registering it in `read_source`.

A text directory holding binary files (a NUL byte or a known signature in a file's
first 8 KiB: archives, images, PDFs, WebDataset shards) is refused before anything
is read, naming them; text that is merely not UTF-8 is read, counted and dropped.

A document is one or more named texts. Plain text has one field, `txt`; a pair
for contrastive training has two, `query.txt` and `passage.txt`. Pairs come
from records (two jsonl fields or table columns) or from Python source
(`pretraining.data.pairs`).
"""

from __future__ import annotations

import json
import re
import sysconfig
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from pretraining.data.documents import CorpusError, Document
from pretraining.data.manifest import SHARD_SUFFIXES
from pretraining.data.tables import is_table_source, read_table_source

# Where a binary file gives itself away, in its first SNIFF_BYTES: a NUL byte, or one of these signatures.
SNIFF_BYTES = 8192
SIGNATURES = {  # at the start of the file; tar's is at offset 257 (see binary_kind)
    "gzip": rb"\x1f\x8b",
    "bzip2": rb"BZh[1-9](1AY&SY|\x17rE8P\x90)",  # a block, or the end of an empty stream
    "xz": rb"\xfd7zXZ\x00",
    "zstd": rb"\x28\xb5\x2f\xfd",
    "zip": rb"PK(\x03\x04|\x05\x06)",
    "PNG": rb"\x89PNG\r\n\x1a\n",
    "JPEG": rb"\xff\xd8\xff",
    "GIF": rb"GIF8[79]a",
    "PDF": rb"%PDF-",
}


def normalize(text: str) -> str:
    """Unicode NFC, Unix newlines, no trailing whitespace or leading blank lines."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.rstrip().lstrip("\n")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_stdlib() -> Iterator[Document]:
    """Every `.py` file of the running Python's standard library (no site-packages)."""
    root = stdlib_root()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts:
            continue
        yield _read_text_file(path, f"stdlib:{relative.as_posix()}")


def text_files(root: Path, pattern: str = "**/*") -> list[Path]:
    """The files under `root` matching `pattern`, sorted, but those in hidden directories (`.git`) or in
    `__pycache__`: a source tree's machinery, not its text."""
    return sorted(
        path
        for path in root.glob(pattern)
        if path.is_file()
        and not any(p.startswith(".") or p == "__pycache__" for p in path.relative_to(root).parent.parts)
    )


def read_text_files(root: Path, pattern: str = "**/*") -> Iterator[Document]:
    """Every file of `text_files`, one document per file."""
    for path in text_files(root, pattern):
        yield _read_text_file(path, f"{root.name}:{path.relative_to(root).as_posix()}")


def binary_kind(path: Path) -> str | None:
    """What binary `path` is ("tar", "gzip", ..., or "NUL bytes"), by its first SNIFF_BYTES; None for text."""
    with path.open("rb") as file:
        head = file.read(SNIFF_BYTES)
    if head[257:262] == b"ustar":
        return "tar"
    kind = next((kind for kind, magic in SIGNATURES.items() if re.match(magic, head)), None)
    return kind or ("NUL bytes" if b"\0" in head else None)


def refuse_binary_files(paths: Iterable[Path]) -> None:
    """Raise a CorpusError naming the binary files among `paths` (which are all read first): a text
    source holding archives or images is a mistake, better said before a build than found in its shards."""
    binary = [(path, kind) for path in paths if (kind := binary_kind(path))]
    if not binary:
        return
    named = ", ".join(f"{path} ({kind})" for path, kind in binary[:5])
    more = f" and {len(binary) - 5} more" if len(binary) > 5 else ""
    message = f"{len(binary)} binary file(s) where text was expected: {named}{more}; remove them from the source"
    if any(kind == "tar" or path.name.endswith(SHARD_SUFFIXES) for path, kind in binary):
        message += (
            ". Tar archives look like WebDataset shards: to train on shards you already have, "
            "write their manifest in place with `pretrain-data index` instead of building"
        )
    raise CorpusError(message)


def read_jsonl(
    path: Path, text_fields: dict[str, str] | None = None, id_field: str | None = None
) -> Iterator[Document]:
    """One document per line of a `.jsonl` file (or of each such file in a directory).

    `text_fields` maps each document field to the JSON key holding it (default: `txt` <- `text`).
    """
    text_fields = text_fields or {"txt": "text"}
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    for file in files:
        for number, record in jsonl_records(file):
            texts = {name: record.get(key) for name, key in text_fields.items()} if isinstance(record, dict) else {}
            if not texts or not all(isinstance(text, str) for text in texts.values()):
                keys = " and ".join(repr(key) for key in text_fields.values())
                raise CorpusError(
                    f"{file}:{number} is not a JSON object with string {keys} fields; fix the line "
                    f"or name the right fields (--text-field, or --query-field/--passage-field with --pairs)"
                )
            if id_field and record.get(id_field) is None:
                raise CorpusError(f"{file}:{number} has no {id_field!r} field; fix the line or drop --id-field")
            source_id = str(record[id_field]) if id_field else f"{file.name}:{number}"
            yield Document(source_id, cast(dict[str, str], texts))


def jsonl_records(file: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a `.jsonl` file; the value is None
    where the line is not JSON (or not UTF-8, -16 or -32): the caller names the line in its error."""
    with file.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)  # bytes: the encoding is detected
            except (json.JSONDecodeError, UnicodeDecodeError):
                yield number, None


# Files holding records in formats that are not read: taken as one text document, they would be a mistake.
RECORD_LOOKALIKES = (".json", ".csv", ".tsv")


def read_source(
    source: str, text_fields: dict[str, str] | None = None, id_field: str | None = None
) -> Iterator[Document]:
    """Dispatch a source string to its reader. `text_fields` (document field -> key or column) and
    `id_field` are for records: jsonl and tables. What can be checked before the first document is
    (the source exists; a table's columns; a text directory holds no binary files), so that a build
    stops before it writes anything."""
    if source == "stdlib":
        refuse_id_field(source, id_field)
        return read_stdlib()
    path = Path(source)
    if not path.exists():
        raise CorpusError(
            f"corpus source {source!r} does not exist; pass an existing text file or directory, a .jsonl or .parquet "
            f"file, a dataset saved by datasets' save_to_disk, or 'stdlib' for the Python standard library corpus"
        )
    if is_table_source(path):
        return read_table_source(path, text_fields or {"txt": "text"}, id_field)
    if is_jsonl_source(source):
        return read_jsonl(path, text_fields, id_field)
    if path.is_dir():
        refuse_id_field(source, id_field)
        refuse_binary_files(text_files(path))
        return read_text_files(path)
    refuse_binary_files([path])
    if path.suffix.lower() in RECORD_LOOKALIKES:
        raise CorpusError(
            f"corpus source {source!r} is a {path.suffix} file, which is read neither as text nor as records: "
            f"name JSON Lines .jsonl, convert a table to .parquet, or pass a text file or a directory of them"
        )
    refuse_id_field(source, id_field)
    return iter([_read_text_file(path, f"{path.parent.name}:{path.name}")])  # one text file: one document


def refuse_id_field(source: str, id_field: str | None) -> None:
    """Text files are identified by their paths: an id field, which only records have, is a mistake to say."""
    if id_field:
        raise CorpusError(
            f"--id-field={id_field} names a field of records (jsonl, Parquet, a saved dataset), but {source!r} is read "
            f"as text files, each identified by its path: drop --id-field"
        )


def is_record_source(source: str) -> bool:
    """A source of records with named fields (jsonl or a table): pairs are two of its fields."""
    return source != "stdlib" and (is_table_source(Path(source)) or is_jsonl_source(source))


def is_jsonl_source(source: str) -> bool:
    """A `.jsonl` file, or a directory holding some: read as jsonl records, not as text files."""
    path = Path(source)
    return path.suffix == ".jsonl" or (path.is_dir() and any(path.rglob("*.jsonl")))


def _read_text_file(path: Path, source_id: str) -> Document:
    try:
        return Document(source_id, {"txt": path.read_text(encoding="utf-8")})
    except UnicodeDecodeError:
        return Document(source_id, None)
