"""The sources a run reads, checked at start-up (`load_source`, `checked_shards`), and the limit on the
samples bad data may cost (`check_skips`: at start-up, then at every logging step by `DataCounts`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from pretraining.data.formats import ExampleFormat
from pretraining.data.manifest import MANIFEST, Manifest
from pretraining.data.mixture import Source, SourceSettings
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError, ShardError


def load_source(
    source: SourceSettings,
    tokenizer: Tokenizer,
    format: Callable[..., ExampleFormat[Any]],
    run_format: ExampleFormat[Any],
    trust_pipe_commands: bool,
) -> Source:
    """A source's manifest, checked for a training split and the fields its format (with the source's own
    `fields`, else `run_format`) reads; not its shards (`checked_shards`)."""
    unknown = sorted(set(source.fields) - set(run_format.field_keys))
    if unknown:
        raise ConfigError(
            f"{source.key}.fields.{unknown[0]}: a source names only its sample fields, which data.format names "
            f"as {', '.join(run_format.field_keys)} (its lengths are the run's)"
        )
    source_format = format(tokenizer, **source.fields) if source.fields else run_format
    key, trust = f"{source.key}.dir", trust_pipe_commands
    manifest = Manifest.load(source.dir, check=False, key=key, trust_pipe_commands=trust)
    if not manifest.splits.get("train"):
        raise ShardError(
            f"{source.key}.dir={source.dir}: its manifest ({manifest.directory / MANIFEST}) lists no "
            f"training shards: rebuild them with more data (or a smaller --validation-fraction), or point "
            f"{source.key}.dir at a directory that has them"
        )
    if source.key == "data":
        fields_key = "data.format"
        fix = (
            "set it to one of those (a .json key reads as json:<key>), or choose the data config that matches "
            "these shards (data=text, data=pairs)"
        )
    else:  # a source of a mixture reads data.format's fields, or its own
        fields_key = f"{source.key}.fields" if source.fields else "data.format"
        example = next(iter(source_format.field_keys))
        fix = (
            f"every source of a mixture needs them: give {source.key} its own, ++{source.key}.fields.{example}="
            "<one of those> (a .json key reads as json:<key>)"
        )
    manifest.require_fields([(f"{fields_key}.{key}", name) for key, name in source_format.field_keys.items()], fix)
    if negatives := source_format.fields[len(source_format.field_keys) :]:  # a pair's hard negatives, in order
        manifest.require_fields(
            [("data.format.hard_negatives", negatives[-1])],
            f"mine them into a copy of the shards, `pretrain-data negatives --data {source.dir} --count "
            f"{len(negatives)} --out <dir>`, and train on it ({source.key}.dir=<dir>), or set "
            "data.format.hard_negatives=0",
        )
    return Source(source, manifest, source_format)


def checked_shards(source: Source, verify_checksums: bool, bad_data: str) -> Source:
    """A source with its shards checked: one missing or altered stops the run under `bad_data=raise`, else is
    skipped in its turn (`refused`)."""
    if bad_data == "raise":
        source.manifest.check(verify_checksums)
        return source
    return dataclasses.replace(source, refused=source.manifest.problems(verify_checksums))


def refused_samples(sources: list[Source]) -> int:
    """The training samples of the shards refused at start-up (missing or altered), with a warning for each."""
    lost = 0
    for source in sources:
        for name, problem in source.refused.items():
            warnings.warn(f"shard {source.manifest.location(name)}: {problem}; it is skipped", stacklevel=2)
        lost += sum(shard.samples for shard in source.manifest.shards("train") if shard.name in source.refused)
    return lost


def check_skips(skipped: int, read: int, sources: list[Source], max_skip_fraction: float) -> None:
    """Stop if more than `max_skip_fraction` of the training samples were skipped: of those read, or of the
    whole split while fewer were read (one bad shard read early is judged against all the data)."""
    denominator = max(read, sum(shard.samples for source in sources for shard in source.manifest.shards("train")))
    if skipped > max_skip_fraction * denominator:
        raise ShardError(
            f"{skipped} of {denominator} training samples were skipped as unusable ({skipped / denominator:.2%}), "
            f"more than data.max_skip_fraction={max_skip_fraction}: the warnings above name the shards "
            f"and samples; rebuild or remove them (`pretrain-data build`), or raise data.max_skip_fraction. "
            f"The checkpoints saved so far are intact"
        )
