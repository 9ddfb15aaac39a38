"""`pretrain-data index`: a manifest for WebDataset shards that already exist, left where they are.

Shards are named as WebDataset names them: a local directory (its `.tar`, `.tar.gz` and `.tgz` files),
a glob, a brace list (`train-{000000..000099}.tar`), a URL or a `pipe:` command (read through
`webdataset.gopen`, brace lists expanded). Each shard is read once, whole: its samples are counted
(a damaged shard is refused, naming it), the fields of every sample are recorded (tar member
extensions, and `json:<key>` for each string value of a `.json` member), and so are its size and
sha256 (for remote shards only with `--remote-checksums`: checking them means reading them again).
Training runs the `pipe:` commands a manifest names only when told to trust them
(`data.trust_pipe_commands=true`): a manifest is a file, and one from elsewhere could name any command.

The manifest names each shard by where it is (relative to the manifest when under its directory, so
the two move together), and its version is a hash of the fields and the shards' names, sample counts,
sizes and checksums: an unchanged set indexed again has the same version, so a run resumes on it.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import webdataset as wds
from braceexpand import braceexpand
from rich.progress import Progress

from pretraining.data.digest import Digest
from pretraining.data.manifest import MANIFEST, PAIR_FIELDS, SHARD_SUFFIXES, SPLITS, ShardInfo, is_command, is_remote
from pretraining.data.reader import ShardReadError, read_shard, sample_texts
from pretraining.data.shards import FORMAT
from pretraining.errors import ShardError
from pretraining.files import write_atomically

SPLIT_RULE = "the shards named by --validation, or the fraction of shards with the lowest stable hash of their name"


@dataclass
class IndexedShard:
    """What reading one shard found."""

    url: str
    samples: int
    bytes: int
    sha256: str | None
    fields: Counter[str] = field(default_factory=Counter)  # samples having each field
    unusable: Counter[str] = field(default_factory=Counter)  # samples whose field is empty or not text


def expand(spec: str) -> list[str]:
    """The shards `spec` names, in order: a URL or `pipe:` command (brace lists expanded), or local
    paths: a directory's shard files (sorted), a glob's matches (sorted), a brace list or a file."""
    if is_remote(spec):
        return list(braceexpand(spec))
    found: list[str] = []
    for name in braceexpand(spec):
        path = Path(name)
        if path.is_dir():
            matches, problem = (
                sorted(str(p) for p in path.iterdir() if p.name.endswith(SHARD_SUFFIXES)),
                f"holds no shards ({', '.join(SHARD_SUFFIXES)} files)",
            )
        elif glob.has_magic(name):
            matches, problem = sorted(glob.glob(name)), "matches no file"
        else:
            matches, problem = ([name] if path.is_file() else []), "does not exist"
        if not matches:
            raise ShardError(f"{name} {problem}: name shard files, a directory of them, a glob, a brace list or a URL")
        found += [str(Path(match).resolve()) for match in matches]
    return found


def read_shard_index(url: str, checksum: bool) -> IndexedShard:
    """Read a shard whole: its samples and fields, its size, and (with `checksum`) its sha256."""
    digest: Digest | None = None

    def opened(url: str) -> Digest:
        nonlocal digest
        digest = Digest(wds.gopen(url))
        return digest

    fields: Counter[str] = Counter()
    unusable: Counter[str] = Counter()
    samples = 0
    try:
        for sample in read_shard(url, opened):
            samples += 1
            present = sample_fields(sample)
            fields.update(present)
            unusable.update(name for name in present if isinstance(sample_texts(sample, [name]), str))
    except ShardReadError as error:
        raise ShardError(f"{error}: it cannot be indexed; repair it or leave it out") from error
    assert digest is not None  # read_shard opened the shard, or raised a ShardReadError
    return IndexedShard(url, samples, digest.bytes, digest.sha256.hexdigest() if checksum else None, fields, unusable)


def sample_fields(sample: dict[str, Any]) -> set[str]:
    """The fields a text format can read from a sample: its members, and the string values of its
    `.json` member as `json:<key>`."""
    fields = {name for name in sample if not name.startswith("__")}
    if "json" in sample:
        try:
            record = json.loads(sample["json"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict):
            fields |= {f"json:{key}" for key, value in record.items() if isinstance(value, str)}
    return fields


def split_shards(
    train: Sequence[str], validation: Sequence[str], validation_fraction: float | None
) -> dict[str, list[str]]:
    """The shard URLs of each split: those named, or a fraction of the training ones for validation."""
    if not train:
        raise ShardError("no training shards to index: name some")
    repeated = [url for url, count in Counter([*train, *validation]).items() if count > 1]
    if repeated:
        raise ShardError(
            f"{repeated[0]} is named twice ({len(repeated)} shards are; a directory or glob names all its shards): "
            f"name each shard once, e.g. the training shards by a glob that leaves out the validation ones"
        )
    if validation_fraction is None:
        return {"train": list(train), "validation": list(validation)}
    if not 0 <= validation_fraction < 1:
        raise ShardError(f"--validation-fraction={validation_fraction} must be in [0, 1)")
    count = max(1, round(validation_fraction * len(train))) if validation_fraction else 0
    if count >= len(train):
        raise ShardError(
            f"--validation-fraction={validation_fraction} of {len(train)} shards leaves none for training: name "
            f"validation shards with --validation, or index more shards"
        )
    # By a hash of the shard's file name, so that the split does not depend on where the shards are.
    held_out = set(sorted(train, key=lambda url: hashlib.sha256(url.rsplit("/", 1)[-1].encode()).digest())[:count])
    return {
        "train": [url for url in train if url not in held_out],
        "validation": [url for url in train if url in held_out],
    }


def index_shards(
    train: Sequence[str],
    out: Path,
    validation: Sequence[str] = (),
    validation_fraction: float | None = None,
    remote_checksums: bool = False,
    workers: int = 8,
    show_progress: bool = True,
) -> dict:
    """Index the shards that the specs `train` and `validation` name (see `expand`) and write the
    manifest into `out` (atomically); return it."""
    if validation and validation_fraction is not None:
        raise ShardError("give --validation or --validation-fraction, not both")
    if workers < 1:
        raise ShardError(f"--workers={workers} must be at least 1")
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise ShardError(f"--out {out} is a file: name a directory (new, or the shards' own) for {MANIFEST}")
    urls = split_shards(
        [url for spec in train for url in expand(spec)],
        [url for spec in validation for url in expand(spec)],
        validation_fraction,
    )
    everything = [url for split in SPLITS for url in urls[split]]
    with Progress(disable=not show_progress, transient=True) as progress, ThreadPoolExecutor(workers) as pool:
        task = progress.add_task("indexing shards", total=len(everything))
        found = {}
        for shard in pool.map(lambda url: read_shard_index(url, remote_checksums or not is_remote(url)), everything):
            found[shard.url] = shard
            progress.advance(task)
    manifest = index_manifest({split: [found[url] for url in urls[split]] for split in SPLITS}, out)
    manifest["sources"] = {"train": list(train), "validation": list(validation)}
    manifest["validation_fraction"] = validation_fraction
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


def index_manifest(splits: dict[str, list[IndexedShard]], out: Path) -> dict:
    """The manifest of indexed shards, their names relative to `out` where under it."""
    every = [shard for shards in splits.values() for shard in shards]
    counts = sum((shard.fields for shard in every), Counter())
    total = sum(shard.samples for shard in every)
    fields = sorted(name for name, count in counts.items() if count == total)
    body = {
        "fields": fields,
        "splits": {
            split: {
                "documents": sum(shard.samples for shard in shards),
                "shards": [asdict(ShardInfo(shard_name(s.url, out), s.samples, s.bytes, s.sha256)) for s in shards],
            }
            for split, shards in splits.items()
        },
    }
    version = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "version": version,
        "format": FORMAT,
        "indexed": True,
        **body,
        "field_counts": dict(sorted(counts.items())),
        "unusable_counts": dict(sorted(sum((shard.unusable for shard in every), Counter()).items())),
        "split_rule": SPLIT_RULE,
    }


def shard_name(url: str, out: Path) -> str:
    """How the manifest names a shard: relative to its directory where under it, else as given."""
    if is_remote(url):
        return url
    path = Path(url)
    return path.relative_to(out).as_posix() if path.is_relative_to(out) else path.as_posix()


def summary(manifest: dict, out: Path) -> Iterable[str]:
    """What `pretrain-data index` prints: what it wrote, the fields found and how to train on it."""
    splits = manifest["splits"]
    yield f"wrote {out / MANIFEST}: version {manifest['version']}, " + ", ".join(
        f"{name} {s['documents']} samples in {len(s['shards'])} shards" for name, s in splits.items()
    )
    counts = manifest["field_counts"]
    partly = [f"{name} ({count})" for name, count in counts.items() if name not in manifest["fields"]]
    yield f"fields of every sample: {', '.join(manifest['fields']) or 'none'}" + (
        f"; of some: {', '.join(partly)}" if partly else ""
    )
    for name, count in manifest["unusable_counts"].items():
        total = counts[name]
        yield (
            f"warning: {count} of {total} samples ({count / total:.2%}) have an empty or undecodable {name}: "
            f"training on {name} skips them, and stops where more than data.max_skip_fraction (default 0.01) of "
            f"the samples it reads are skipped: leave them out of the shards, or raise data.max_skip_fraction"
        )
    if not splits["validation"]["shards"]:
        yield "warning: no validation shards, which training validates on: index with --validation(-fraction)"
    yield training_command(manifest, out)


def training_command(manifest: dict, out: Path) -> str:
    """The line that says how to train on the shards of `manifest` in `out`: the next step after
    `pretrain-data build` or `index`."""
    return f"train on it: pretrain data.dir={out}{' '.join(['', *training_overrides(manifest)])}"


def training_overrides(manifest: dict) -> list[str]:
    """What `pretrain data.dir=<out>` needs besides, for these shards."""
    fields, overrides = set(manifest["fields"]), []
    if set(PAIR_FIELDS) <= fields:
        overrides.append("data=pairs")
    elif "txt" not in fields:
        text = next((field for field in ("text", "json:text") if field in fields), "FIELD")
        overrides.append(f"data.format.text_field={text}")
    names = [shard["name"] for split in manifest["splits"].values() for shard in split["shards"]]
    if any(is_command(name) for name in names):
        overrides.append("data.trust_pipe_commands=true")
    return overrides
