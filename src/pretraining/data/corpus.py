"""Corpus readers: each turns a source into `Document`s with a stable source id.

A source is named by a string: `stdlib` (the Python standard library's own
source, present wherever Python is), a directory of text files, or a `.jsonl`
file (or a directory of them) with a text field. Adding a corpus means adding
one reader here and registering it in `read_source`.
"""

from __future__ import annotations

import json
import sysconfig
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    """One document. `source_id` is stable across builds and decides the split.

    `text` is None for a file that is not valid UTF-8: the builder counts and drops it.
    """

    source_id: str
    text: str | None


class CorpusError(ValueError):
    """A corpus source that cannot be read; the message names the fix."""


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
        yield from _read_text_file(path, f"stdlib:{relative.as_posix()}")


def read_text_files(root: Path, pattern: str = "**/*") -> Iterator[Document]:
    """Every file under `root` matching `pattern`, one document per file."""
    for path in sorted(p for p in root.glob(pattern) if p.is_file()):
        yield from _read_text_file(path, f"{root.name}:{path.relative_to(root).as_posix()}")


def read_jsonl(path: Path, text_field: str = "text", id_field: str | None = None) -> Iterator[Document]:
    """One document per line of a `.jsonl` file (or of each such file in a directory)."""
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    for file in files:
        with file.open("rb") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)  # bytes: UTF-8 (or -16/-32) is detected, anything else fails
                except (json.JSONDecodeError, UnicodeDecodeError):
                    record = None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise CorpusError(
                        f"{file}:{number} is not a JSON object with a string {text_field!r} field; "
                        f"fix the line or pass --text-field with the right field name"
                    )
                source_id = str(record[id_field]) if id_field else f"{file.name}:{number}"
                yield Document(source_id, text)


def read_source(source: str, text_field: str = "text") -> Iterator[Document]:
    """Dispatch a source string to its reader."""
    if source == "stdlib":
        return read_stdlib()
    path = Path(source)
    if not path.exists():
        raise CorpusError(
            f"corpus source {source!r} does not exist; pass an existing directory, a .jsonl file, "
            f"or 'stdlib' for the built-in Python standard library corpus"
        )
    if path.suffix == ".jsonl" or (path.is_dir() and any(path.rglob("*.jsonl"))):
        return read_jsonl(path, text_field)
    if path.is_dir():
        return read_text_files(path)
    raise CorpusError(f"corpus source {source!r} is a file but not .jsonl; pass its directory instead")


def _read_text_file(path: Path, source_id: str) -> Iterator[Document]:
    try:
        text: str | None = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = None
    yield Document(source_id, text)
