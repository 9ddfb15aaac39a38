"""A weighted mixture of shard sets (`data.sources`; `data.dir` is a mixture of one): which source each
training example comes from. A weight is a share of the training tokens: sources are packed apart and mixed
afterwards, so every example holds the same number of tokens.

The source of the run's k-th example (k = step x global batch + its place in it) is a pure function of the seed
and k, whatever the devices, workers or micro-batches: a Weyl sequence (k times the golden ratio, mod 1, from a
seeded offset) read against the cumulative weights, which keeps each source's share close to its weight over
any run of examples.

Each source is read by its own shard streams, one per sub-stream of the batches, so the data position is a
cursor per (source, sub-stream). A source may name its own sample `fields` and cap its passes (`max_epochs`);
a sub-stream that reaches the cap has run out of it, and the others fill its share. `exhausted`: `stop` (the
default) saves and stops at the next logging step and refuses to continue until the cap is raised;
`renormalise` goes on, with a warning.
"""

from __future__ import annotations

import bisect
import itertools
import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pretraining.data.formats import ExampleFormat
from pretraining.data.manifest import Manifest
from pretraining.data.stream import Cursor, ShardStream, StreamExample, stable_hash
from pretraining.errors import ConfigError, ShardError

Exhausted = Literal["stop", "renormalise"]
SOURCE_KEYS = ("dir", "weight", "max_epochs", "exhausted", "fields")
WEYL_STEP = 0x9E3779B97F4A7C15  # 2**64 divided by the golden ratio (odd): the sequence's step, in 64-bit fixed point


@dataclass(frozen=True)
class SourceSettings:
    """One entry of `data.sources`, checked."""

    name: str
    dir: str
    weight: float = 1.0
    max_epochs: int | None = None  # passes over its shards before it runs out; None: never
    exhausted: Exhausted = "stop"
    key: str = "data"  # where it is configured: data (data.dir) or data.sources.<name>
    # Its own sample fields, by data.format key (text_field: query.txt), where they differ from data.format's.
    fields: Mapping[str, str] = field(default_factory=dict)


def source_settings(sources: Mapping[str, Mapping[str, Any]] | None, dir: str | None) -> list[SourceSettings]:
    """The sources of a run: `data.sources`, or `data.dir` as a mixture of one; a bad entry stops the run
    before any data is read."""
    if (sources is None) == (dir is None):
        raise ConfigError(
            "set exactly one of data.dir (one shard directory) and data.sources (a mixture: name -> dir, weight); "
            f"got data.dir={dir} and data.sources={None if sources is None else dict(sources)} (set the other to null)"
        )
    if dir is not None:
        return [SourceSettings(name=dir.rstrip("/").rsplit("/", 1)[-1] or "data", dir=dir)]
    if not sources:
        raise ConfigError("data.sources is empty: name at least one shard directory (data.sources.<name>.dir=<dir>)")
    settings = [one_source(str(name), entry) for name, entry in sources.items()]
    check_total_weight(settings)
    return settings


def check_total_weight(settings: Sequence[SourceSettings]) -> None:
    """Refuse weights whose sum the mixture cannot divide by: all zero, or a sum that overflows to infinity
    (or is too small for a float's full precision), which would send examples to a source that is not there."""
    total = sum(source.weight for source in settings)
    if total == 0:
        raise ConfigError(
            "the weights of data.sources are all zero: give at least one source a positive weight "
            "(a source of weight 0 is only validated on)"
        )
    if not sys.float_info.min <= total <= sys.float_info.max:
        weights = ", ".join(f"{source.key}.weight={source.weight:g}" for source in settings)
        raise ConfigError(
            f"{weights}: their sum ({total:g}) is out of a float's range; a weight is a share, so scale them in "
            f"proportion (0.7 and 0.3 mix as 7 and 3 do)"
        )


def one_source(name: str, entry: Mapping[str, Any] | None) -> SourceSettings:
    key = f"data.sources.{name}"
    if not isinstance(entry, Mapping) or entry.get("dir") is None:
        raise ConfigError(f"{key} has no dir: set {key}.dir=<shard directory> (and {key}.weight)")
    unknown = sorted(set(entry) - set(SOURCE_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a setting of a source: a source has {', '.join(SOURCE_KEYS)}")
    weight, max_epochs = entry.get("weight", 1.0), entry.get("max_epochs")
    exhausted = entry.get("exhausted", "stop")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
        raise ConfigError(
            f"{key}.weight={weight!r}: a weight is a finite number >= 0 (its share of the training tokens)"
        )
    if max_epochs is not None and (isinstance(max_epochs, bool) or not isinstance(max_epochs, int) or max_epochs < 1):
        raise ConfigError(f"{key}.max_epochs={max_epochs!r}: a whole number of passes >= 1, or null for no cap")
    if exhausted not in get_args(Exhausted):
        raise ConfigError(f"{key}.exhausted={exhausted!r}: use one of {', '.join(get_args(Exhausted))}")
    fields = entry.get("fields") or {}
    if not isinstance(fields, Mapping):
        raise ConfigError(f"{key}.fields={fields!r}: a mapping of data.format's field keys (text_field: query.txt)")
    return SourceSettings(name, str(entry["dir"]), float(weight), max_epochs, exhausted, key, dict(fields))


@dataclass(frozen=True)
class Source:
    """A source of the run: settings, manifest, the format that reads its fields, and the shards refused at
    start-up (name -> reason, under `data.bad_data=skip`)."""

    settings: SourceSettings
    manifest: Manifest
    format: ExampleFormat[Any]
    refused: Mapping[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def weight(self) -> float:
        return self.settings.weight


class Mixture:
    """Which source the run's k-th training example comes from (see module doc)."""

    def __init__(self, sources: Sequence[SourceSettings], seed: int) -> None:
        self.sources, self.seed = list(sources), seed
        self.offset = stable_hash("mixture", seed) % 2**64
        # A source without weight gets an empty interval, which bisect never lands on.
        self.bounds = list(itertools.accumulate(source.weight for source in self.sources))

    def source_of(self, example: int, out: frozenset[int] = frozenset()) -> int:
        """The source of the run's `example`-th example. Where the point falls on a source that is out, further
        points (hashed from seed, example, try) are drawn until one is not: the result depends only on which
        sources are out, not on the order they ran out in, so a resumed run draws what the uninterrupted one drew."""
        if out and not self.has_weight(out):
            raise ValueError(f"every source with weight is out: {sorted(out)}")
        point = (((example * WEYL_STEP + self.offset) % 2**64) >> 11) / 2**53  # 53 bits: exactly below 1
        attempt = 0
        while (source := bisect.bisect_right(self.bounds, point * self.bounds[-1])) in out:
            point = (stable_hash("mixture", self.seed, example, attempt) >> 10) / 2**53
            attempt += 1
        return source

    def has_weight(self, out: frozenset[int]) -> bool:
        """Whether a source with weight is left when the sources `out` have run out."""
        return any(source.weight > 0 for index, source in enumerate(self.sources) if index not in out)


class MixedExamples:
    """A rank's (or worker's) reader of the mixture: a sub-stream's next example, from the source the mixture
    names, read by that source's shard stream from its cursor."""

    def __init__(
        self, streams: Sequence[ShardStream], mixture: Mixture, total: int, cursors: Mapping[tuple[int, int], Cursor]
    ) -> None:
        self.streams, self.mixture, self.total, self.cursors = streams, mixture, total, cursors
        self.readers: dict[tuple[int, int], Iterator[StreamExample]] = {}
        self.out: dict[int, frozenset[int]] = {}  # by sub-stream: the sources it has run out of

    def next(self, sub: int, example: int, step: int) -> tuple[int, StreamExample]:
        """(source, example) of the run's `example`-th example, which sub-stream `sub` reads at `step`."""
        while True:
            source = self.mixture.source_of(example, self.out.get(sub, frozenset()))
            try:
                return source, next(self.reader(source, sub))
            except StopIteration:
                self.run_out(source, sub, step)

    def reader(self, source: int, sub: int) -> Iterator[StreamExample]:
        if (source, sub) not in self.readers:
            start = self.cursors.get((source, sub), Cursor())
            self.readers[source, sub] = self.streams[source].examples(sub, self.total, start)
        return self.readers[source, sub]

    def run_out(self, source: int, sub: int, step: int) -> None:
        """Take `source` out of sub-stream `sub`: the others fill its share from here on (one that stops the run
        does so at the next logging step: `DataPosition.stop_reason`)."""
        settings = self.mixture.sources[source]
        if settings.exhausted == "renormalise":
            warnings.warn(
                f"{settings.key} has run out at step {step} ({settings.key}.max_epochs={settings.max_epochs}): its "
                f"weight is shared among the other sources from here on ({settings.key}.exhausted=renormalise)",
                stacklevel=2,
            )
        self.out[sub] = self.out.get(sub, frozenset()) | {source}
        if not self.mixture.has_weight(self.out[sub]):
            raise ShardError(
                f"at step {step} every source with weight has run out (data.sources.<name>.max_epochs): raise "
                f"a cap and continue with resume_allow=[mixture]"
            )

    @property
    def ran_out(self) -> list[bool]:
        """Whether each source has run out in a sub-stream read here."""
        out = frozenset().union(*self.out.values())
        return [source in out for source in range(len(self.streams))]
