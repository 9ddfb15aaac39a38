"""A shard directory's `manifest.json` (written by `pretraining.data.shards` or `pretraining.data.index`),
read back and checked. A shard's `name` is where it is: a path relative to the directory, an absolute path,
or a URL or `pipe:` command (remote: checked while read, by checksum only where the index recorded one)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import webdataset as wds

from pretraining.data.reader import described
from pretraining.errors import ShardError
from pretraining.files import regular_file, sha256_of

TEXT_FIELDS: tuple[str, ...] = ("txt",)  # the sample field of built text shards
# WebDataset splits a member name at its first dot: key "train-000000001", field "query.txt".
PAIR_FIELDS: tuple[str, ...] = ("query.txt", "passage.txt")  # the sample fields of built pair shards


def negative_fields(count: int) -> tuple[str, ...]:
    """The sample fields of a pair's first `count` hard negatives (`pretraining.data.negatives` mines them)."""
    return tuple(f"negative{rank}.txt" for rank in range(1, count + 1))


SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # the names of tar shards
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"  # where `pretrain-data tokenizer` puts a BPE by default
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard as recorded in the manifest."""

    name: str
    samples: int
    bytes: int
    sha256: str | None  # None: a remote shard indexed without its checksum
    text_bytes: int | None = None  # None: indexed shards (which members are text is the config's choice)


@dataclass(frozen=True)
class Manifest:
    """A loaded, checked manifest: shard lists per split and the dataset version."""

    directory: Path
    version: str
    splits: dict[str, list[ShardInfo]]
    fields: tuple[str, ...] = TEXT_FIELDS  # the fields every sample has
    field_counts: dict[str, int] = field(default_factory=dict)  # samples having each field, where indexed

    @classmethod
    def load(
        cls,
        directory: str | Path,
        verify_checksums: bool = True,
        check: bool = True,
        key: str = "",
        trust_pipe_commands: bool = False,
        trust_option: str = "data.trust_pipe_commands=true",
    ) -> Manifest:
        """The manifest of `directory` (named by `key`); with `check`, refusing missing or altered shards.
        `pipe:` shards are refused unless `trust_pipe_commands` (`trust_option`): a manifest from elsewhere
        could name any command."""
        path = regular_file(
            Path(directory) / MANIFEST, "manifest", "write it again with `pretrain-data build` or `index`"
        )
        if not path.is_file():
            raise ShardError(no_manifest(str(directory), key))
        directory = path.parent
        try:
            raw = json.loads(path.read_text())
            splits = {name: [ShardInfo(**s) for s in split["shards"]] for name, split in raw["splits"].items()}
            fields = tuple(raw.get("fields", TEXT_FIELDS))
            manifest = cls(directory, raw["version"], splits, fields, raw.get("field_counts", {}))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ShardError(
                f"{path} is not a valid manifest ({error}): write it again with `pretrain-data build` or `index`"
            ) from error
        commands = [shard.name for shards in manifest.splits.values() for shard in shards if is_command(shard.name)]
        if commands and not trust_pipe_commands:
            raise ShardError(
                f"{path} reads {len(commands)} shards by running shell commands ({commands[0]!r}), and a manifest "
                f"from elsewhere could name any command: if you trust these (you indexed them yourself), allow them "
                f"with {trust_option}"
            )
        if check:
            manifest.check(verify_checksums)
        return manifest

    def problems(self, verify_checksums: bool = True) -> dict[str, str]:
        """What is wrong with each listed shard that is missing or does not match its entry, by name."""
        found = {}
        for shards in self.splits.values():
            for shard in shards:
                url = self.url(shard)
                problem = None if is_remote(url) else file_problem(Path(url), shard)
                if not problem and verify_checksums and shard.sha256 is not None:
                    problem = checksum_problem(url, shard.sha256, shard.bytes)
                if problem:
                    found[shard.name] = problem
        return found

    def check(self, verify_checksums: bool = True) -> None:
        for name, problem in self.problems(verify_checksums).items():
            raise ShardError(
                f"shard {self.location(name)}: {problem}; rebuild the shards (`pretrain-data build`) or index them "
                f"again (`pretrain-data index`), or train with data.bad_data=skip to skip it"
            )

    def urls(self, split: str) -> list[str]:
        return [self.url(shard) for shard in self.shards(split)]

    def url(self, shard: ShardInfo) -> str:
        return self.location(shard.name)

    def location(self, name: str) -> str:
        """Where the shard the manifest names `name` is read from."""
        return name if is_remote(name) else str(self.directory / name)

    def require_fields(self, settings: list[tuple[str, str]], fix: str) -> None:
        """Stop if a field `settings` name ((setting, field) pairs) is not in every sample, naming `fix`."""
        missing = [(setting, name) for setting, name in settings if name not in self.fields]
        if not missing:
            return
        named = " and ".join(f"{setting}={name!r}" for setting, name in missing)
        partly = "".join(
            f"; {name} is in {self.field_counts[name]} only" for _, name in missing if name in self.field_counts
        )
        raise ShardError(
            f"{named}: not a field of every sample in {self.directory}, whose samples all have "
            f"{', '.join(self.fields) or 'no field in common'}{partly}: {fix}"
        )

    def shards(self, split: str) -> list[ShardInfo]:
        shards = self.splits.get(split, [])
        if not shards:
            raise ShardError(
                f"{self.directory / MANIFEST} lists no {split!r} shards; rebuild with more data "
                f"(or a larger --validation-fraction)"
            )
        return shards


def no_manifest(directory: str, key: str = "") -> str:
    """Why `directory` (named by `key`, if any) is not a shard directory, and the ways out."""
    named = f"{key}={directory}" if key else directory
    elsewhere = f"point {key} at" if key else "use"
    build = f"`pretrain-data build --out {directory}` (or `make data` for the default corpus)"
    path = Path(directory)
    if names_shards(directory):
        return (
            f"{named} names shards, not a directory of shards: write a manifest for them with `pretrain-data index "
            f"'{directory}' --validation-fraction 0.05 --out <dir>` and {elsewhere} <dir>"
        )
    if not path.exists():
        return (
            f"{named}: the directory does not exist: {elsewhere} a directory of shards (one holding {MANIFEST}), "
            f"or build the shards there with {build}"
        )
    if not path.is_dir():
        return f"{named} is a file, not a directory: {elsewhere} a directory of shards (one holding {MANIFEST})"
    if tars := [p for p in path.iterdir() if p.name.endswith(SHARD_SUFFIXES)]:
        return (
            f"{named} holds {len(tars)} tar files but no {MANIFEST}: if they are WebDataset shards, index them "
            f"where they are with `pretrain-data index {directory} --validation-fraction 0.05 --out {directory}`"
        )
    return (
        f"{named} holds no {MANIFEST}, so it holds no shards (or their build did not finish): build them into it "
        f"with {build}, or {elsewhere} a directory that holds them"
    )


def names_shards(spec: str) -> bool:
    """A string naming shards (URL, `pipe:`, brace list, glob, tar file) rather than a directory."""
    return is_remote(spec) or any(c in spec for c in "{*?[") or spec.endswith(SHARD_SUFFIXES)


def is_remote(name: str) -> bool:
    """A shard named by a URL or a `pipe:` command, not a local path."""
    return is_command(name) or "://" in name


def is_command(name: str) -> bool:
    """A shard read by running a shell command (WebDataset's `pipe:`)."""
    return name.startswith("pipe:")


def file_problem(path: Path, shard: ShardInfo) -> str | None:
    """Why a local shard is not the one listed, as far as its size tells."""
    if not path.is_file():
        return "missing (listed in the manifest)"
    if (size := path.stat().st_size) != shard.bytes:
        return f"truncated or altered ({size} bytes, the manifest says {shard.bytes})"
    return None


def checksum_problem(url: str, sha256: str, size: int) -> str | None:
    """Why a shard does not match its recorded checksum: a local file, or a remote one read through."""
    if not is_remote(url):
        found = sha256_of(Path(url))
    else:
        from pretraining.data.digest import Digest  # loaded only by runs that hash remote shards

        try:
            with Digest(wds.gopen(url)) as digest:
                while digest.read(1 << 20):
                    pass
        except Exception as error:  # a URL or command that fails is a shard that cannot be read
            return f"cannot be read ({described(error)})"
        if digest.bytes != size:
            return f"truncated or altered ({digest.bytes} bytes, the manifest says {size})"
        found = digest.sha256.hexdigest()
    return None if found == sha256 else "altered or corrupt (its sha256 differs from the manifest's)"
