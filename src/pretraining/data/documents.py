"""What every corpus reader yields (`Document`) and raises (`CorpusError`).

The readers live in `corpus` (stdlib, text files, jsonl) and `tables` (Parquet, saved `datasets`);
both import these from here, so that `corpus.read_source` can dispatch to either.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Document:
    """One sample. `source_id` is stable across builds and decides the split;
    every pair taken from one file shares the file's id, so a file never spans
    two splits.

    `texts` maps field names to texts; it is None for a file that is not valid
    UTF-8, or a table row whose text is null (the builder counts and drops it).
    `meta` is extra provenance stored with the sample.
    """

    source_id: str
    texts: dict[str, str] | None
    meta: dict[str, str] = field(default_factory=dict)


class CorpusError(ValueError):
    """A corpus source that cannot be read; the message names the fix."""
