"""A shard directory's `manifest.json`, read back and checked: the shards of each split, their sample
counts, sizes and checksums, the sample fields and the dataset version (`pretraining.data.shards`
writes it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pretraining.data.corpus import TEXT_FIELDS
from pretraining.errors import ShardError
from pretraining.files import sha256_of

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"  # where `pretrain-data tokenizer` puts a BPE by default
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard as recorded in the manifest."""

    name: str
    samples: int
    bytes: int
    sha256: str
    text_bytes: int


@dataclass(frozen=True)
class Manifest:
    """A loaded, checked manifest: shard lists per split and the dataset version."""

    directory: Path
    version: str
    splits: dict[str, list[ShardInfo]]
    fields: tuple[str, ...] = TEXT_FIELDS

    @classmethod
    def load(cls, directory: str | Path, verify_checksums: bool = True, check: bool = True, key: str = "") -> Manifest:
        """The manifest of `directory` (named by the config key or option `key`, if any); with `check`,
        refusing shards that are missing or altered (their checksums are read with `verify_checksums`,
        sizes always)."""
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            raise ShardError(no_manifest(directory, key))
        try:
            raw = json.loads(path.read_text())
            splits = {name: [ShardInfo(**s) for s in split["shards"]] for name, split in raw["splits"].items()}
            manifest = cls(directory, raw["version"], splits, tuple(raw.get("fields", TEXT_FIELDS)))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ShardError(f"{path} is not a valid manifest ({error}); rebuild with `pretrain-data build`") from error
        if check:
            manifest.check(verify_checksums)
        return manifest

    def problems(self, verify_checksums: bool = True) -> dict[str, str]:
        """What is wrong with each listed shard that is missing or does not match its entry, by name."""
        found = {}
        for shards in self.splits.values():
            for shard in shards:
                path = self.directory / shard.name
                if not path.is_file():
                    found[shard.name] = "missing (listed in the manifest)"
                elif (size := path.stat().st_size) != shard.bytes:
                    found[shard.name] = f"truncated or altered ({size} bytes, the manifest says {shard.bytes})"
                elif verify_checksums and sha256_of(path) != shard.sha256:
                    found[shard.name] = "altered or corrupt (its sha256 differs from the manifest's)"
        return found

    def check(self, verify_checksums: bool = True) -> None:
        for name, problem in self.problems(verify_checksums).items():
            raise ShardError(
                f"shard {self.directory / name}: {problem}; rebuild the shards with `pretrain-data build` "
                f"(or train with data.bad_data=skip to skip it)"
            )

    def urls(self, split: str) -> list[str]:
        return [self.url(shard) for shard in self.shards(split)]

    def url(self, shard: ShardInfo) -> str:
        return str(self.directory / shard.name)

    def shards(self, split: str) -> list[ShardInfo]:
        shards = self.splits.get(split, [])
        if not shards:
            raise ShardError(
                f"{self.directory / MANIFEST} lists no {split!r} shards; rebuild with more data "
                f"(or a larger --validation-fraction)"
            )
        return shards


def no_manifest(directory: Path, key: str = "") -> str:
    """Why `directory` (named by `key`, if any) is not a shard directory, and the two ways out."""
    named = f"{key}={directory}" if key else str(directory)
    elsewhere = f"point {key} at" if key else "use"
    build = f"`pretrain-data build --out {directory}` (or `make data` for the default corpus)"
    if not directory.exists():
        return (
            f"{named}: the directory does not exist: {elsewhere} a directory of shards (one holding {MANIFEST}), "
            f"or build the shards there with {build}"
        )
    if not directory.is_dir():
        return f"{named} is a file, not a directory: {elsewhere} a directory of shards (one holding {MANIFEST})"
    return (
        f"{named} holds no {MANIFEST}, so it holds no shards (or their build did not finish): build them into it "
        f"with {build}, or {elsewhere} a directory that holds them"
    )
