"""Reading the samples of tar shards under a bad-data policy: `read_shard` groups a shard's members by key,
as WebDataset does; `SampleReader` decodes the fields asked for (`field_text`), skips or stops on what cannot
be used, and counts. Training, validation, tokenizer training, probes and the index all read through it.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import tarfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import webdataset as wds

from pretraining.errors import ConfigError, ShardError

BAD_DATA_POLICIES = ("skip", "raise")
NAMED_SKIPS = 20  # bad samples or shards a reader names in a warning; the rest are only counted


def read_shard(url: str, opener: Callable[[str], Any] = wds.gopen) -> Iterator[dict[str, Any]]:
    """The samples of one tar shard (path, URL or `pipe:` command), undecoded: members grouped by key as
    WebDataset does, plus `__key__` and `__offset__` (the byte offset of its first header). A shard that cannot
    be read on raises `ShardReadError` after its last whole sample, also where tarfile would end the archive
    silently (a header cut short, corrupt or zeroed): the end must be zero blocks and nothing after them."""
    sample: dict[str, Any] = {}
    offset = 0
    problem: Exception | None = None
    try:
        with opener(url) as raw, tarfile.open(fileobj=(file := TailKeeper(decompressed(raw))), mode="r|") as tar:  # type: ignore[call-overload]
            for member in tar:
                offset = member.offset
                if not member.isreg():
                    continue
                directory, _, name = member.name.rpartition("/")
                stem, dot, field = name.partition(".")
                field = field.lower()  # as WebDataset reads it
                key = f"{directory}/{stem}" if directory else stem
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                sample = sample or {"__key__": key, "__offset__": member.offset}
                sample[field if dot else ""] = tar.extractfile(member).read()  # type: ignore[union-attr]
            offset = tar.offset
            problem = file.early_end(tar.offset)
    except Exception as error:  # anything raised while parsing these bytes means they cannot be trusted
        raise ShardReadError(url, offset, error) from error
    if sample:  # its members were read whole (a damaged header after them ends the shard)
        yield sample
    if problem:
        raise ShardReadError(url, offset, problem)


def decompressed(raw: Any) -> Any:
    """The tar bytes of a shard stream, decompressed if gzip, bzip2 or xz: offsets and the end check are then
    the same for all."""
    head = raw.read(6)
    stream = Prefixed(head, raw)
    for magic, opened in COMPRESSIONS:
        if head.startswith(magic):
            return opened(stream)
    return stream


class Prefixed:
    """A stream whose first bytes were read already (to tell its compression)."""

    def __init__(self, head: bytes, rest: Any) -> None:
        self.head, self.rest = head, rest

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(size)
        if size < 0:
            data, self.head = self.head + self.rest.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        return data if len(data) == size else data + self.rest.read(size - len(data))


COMPRESSIONS: list[tuple[bytes, Callable[[Any], Any]]] = [
    (b"\x1f\x8b", lambda stream: gzip.GzipFile(fileobj=stream)),
    (b"BZh", bz2.BZ2File),
    (b"\xfd7zXZ\x00", lzma.LZMAFile),
]


class TailKeeper:
    """A binary stream read through, keeping its last bytes: where a tar archive ends, what follows."""

    KEEP = 1 << 16  # more than tarfile reads ahead (a record, 10 KiB, beyond the header it reads)

    def __init__(self, file: Any) -> None:
        self.file, self.position, self.tail = file, 0, b""

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.position += len(data)
        self.tail = (self.tail + data)[-self.KEEP :]
        return data

    def early_end(self, end: int) -> Exception | None:
        """Why the archive tarfile ended at byte `end` was cut short or damaged there, or None if what
        follows is its end: zero blocks, and nothing else."""
        after = self.position - end
        rest = (self.tail[-after:] if after > 0 else b"") + self.file.read()
        if len(rest) < tarfile.BLOCKSIZE:
            return EOFError(f"the file ends at byte {end + len(rest)}, inside or before a tar header (cut short)")
        if rest.strip(b"\0"):
            return tarfile.HeaderError(f"the tar header at byte {end} is damaged (not a member, not the end)")
        return None


class ShardReadError(Exception):
    """A shard that cannot be read past `offset`: truncated, a corrupt tar header, or unreadable."""

    def __init__(self, url: str, offset: int, cause: BaseException) -> None:
        super().__init__(f"{url} cannot be read past byte {offset}: {described(cause)}")
        self.url, self.offset = url, offset


def described(cause: BaseException) -> str:
    """An error in a line; a failed `pipe:` command or URL by its exit status (webdataset's OSError holds the
    whole call)."""
    if isinstance(cause, OSError) and (status := re.search(r"\): exit (-?\d+) ", str(cause))):
        return f"the command reading it (or curl, for a URL) exited with status {status[1]}"
    return f"{type(cause).__name__}: {cause}"


def field_text(sample: dict[str, Any], field: str) -> str:
    """The text of one sample field: a member (`txt`, `query.txt`) or a key of a JSON member (`json:text`).
    `Unusable` says why there is none."""
    member, _, key = field.partition(":")
    if member not in sample:
        raise Unusable(f"no {member!r} field")
    try:
        text = sample[member].decode("utf-8")
    except UnicodeDecodeError as error:
        raise Unusable(f"{member!r} is not UTF-8") from error
    if key:
        try:
            record = json.loads(text)
        except json.JSONDecodeError as error:
            raise Unusable(f"{member!r} is not JSON") from error
        if not isinstance(record, dict) or key not in record:
            raise Unusable(f"{member!r} has no {key!r} key")
        text = record[key]
        if not isinstance(text, str):
            raise Unusable(f"{field!r} is a {type(text).__name__}, not a string")
    if not text.strip():
        raise Unusable(f"{field!r} is empty")
    return text


class Unusable(Exception):
    """Why a sample gives no text for a field."""


def sample_texts(sample: dict[str, Any], fields: Sequence[str]) -> tuple[str, ...] | str:
    """The sample's texts for `fields` (see `field_text`), or the reason it cannot be used."""
    try:
        return tuple(field_text(sample, field) for field in fields)
    except Unusable as reason:
        return str(reason)


class SampleReader:
    """Reads the texts of `fields` from shards, counting samples read and skipped. An unusable sample, or the
    rest of a shard that cannot be read, is skipped with a warning naming shard, byte offset and sample (policy
    `skip`) or stops the run (`raise`); a shard's lost samples count from its manifest entry, or as one.
    """

    def __init__(self, fields: Sequence[str], policy: str = "skip") -> None:
        if policy not in BAD_DATA_POLICIES:
            raise ConfigError(f"data.bad_data={policy!r} must be one of {', '.join(BAD_DATA_POLICIES)}")
        self.fields, self.policy = tuple(fields), policy
        self.read = self.skipped = 0  # since the last `take`
        self.named = 0  # warnings given

    def texts(self, url: str, samples: int | None = None, again: bool = False) -> Iterator[tuple[str, ...]]:
        """The usable texts of one shard of `samples` samples (None: unknown). `again`: it was read before and
        counted then, so bad data counts once against `data.max_skip_fraction` whatever the epochs and streams."""
        seen = 0
        try:
            for sample in read_shard(url):
                seen += 1
                self.read += not again
                texts = sample_texts(sample, self.fields)
                if isinstance(texts, str):
                    if not again:
                        self.bad(f"sample {sample['__key__']!r} of {url} at byte {sample['__offset__']}: {texts}", 1)
                    continue
                yield texts
        except ShardReadError as error:
            lost = max(1, (samples or 0) - seen)
            self.lose(f"{error} (about {lost} samples lost)", lost, again)
            return
        if samples is not None and seen != samples:  # a whole tar, but not the one the manifest lists
            lost = max(0, samples - seen)
            self.lose(
                f"shard {url} holds {seen} samples, its manifest entry {samples}: cut short or altered", lost, again
            )

    def skip_shard(self, url: str, samples: int, reason: str, again: bool = False) -> None:
        """Count a whole shard refused before reading (see `pretraining.data.manifest.Manifest.problems`)."""
        self.lose(f"shard {url}: {reason} ({samples} samples)", samples, again)

    def lose(self, problem: str, samples: int, again: bool) -> None:
        """The rest of a shard lost: counted as read and skipped at its first epoch, named every time."""
        self.read += 0 if again else samples
        self.bad(problem, 0 if again else samples)

    def bad(self, problem: str, samples: int) -> None:
        if self.policy == "raise":
            raise ShardError(
                f"bad data: {problem}. data.bad_data=raise stops on it: set data.bad_data=skip to skip and count "
                f"such samples (data/skipped_samples, stopping above data.max_skip_fraction), or rebuild the shards"
            )
        self.skipped += samples
        self.named += 1
        if self.named <= NAMED_SKIPS:
            last = (
                "; further ones of this stream are only counted (data/skipped_samples)"
                if self.named == NAMED_SKIPS
                else ""
            )
            warnings.warn(f"skipped {problem}{last}", stacklevel=2)

    def take(self) -> tuple[int, int]:
        """(samples read, samples skipped) since the last call."""
        counts = self.read, self.skipped
        self.read = self.skipped = 0
        return counts

    def all_texts(self, urls: Iterable[str]) -> Iterator[tuple[str, ...]]:
        for url in urls:
            yield from self.texts(url)
