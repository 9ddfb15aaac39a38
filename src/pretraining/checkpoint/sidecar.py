"""A checkpoint's sidecar, `<checkpoint>.json` (checksum, size, step, lineage, shapes; written last), and
the verification of a checkpoint, a file or a sharded directory, against it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pretraining.errors import CheckpointError
from pretraining.files import regular_file, sha256_of, write_durably

SIDECAR_FORMAT = 1
# In a sharded checkpoint: all but the weights and optimizer, as Lightning names it (fabric.utilities.load).
SHARDED_META = "meta.pt"
DCP_METADATA = ".metadata"  # DCP's pickled index of every tensor's shards
# The lineage record of `pretraining.callbacks.lineage.Lineage`; earlier formats' configs name classes now gone.
LINEAGE_FORMAT = 4
READABLE_LINEAGE_FORMATS = (4,)


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_sidecar(path: Path) -> Any:
    """The record of a checkpoint's sidecar, parsed (not verified: see `verify`)."""
    sidecar = regular_file(sidecar_path(path), "checkpoint sidecar", "use another checkpoint")
    return json.loads(sidecar.read_text())


def write_sidecar(path: Path, record: dict[str, Any]) -> None:
    write_durably(sidecar_path(path), lambda file: file.write(json.dumps(record, indent=1).encode()))


def parameter_shapes(state_dict: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {name: list(tensor.shape) for name, tensor in state_dict.items()}


def summary(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a resume checks before loading: step, lineage (without the config) and parameter shapes."""
    lineage = {key: value for key, value in checkpoint.get("lineage", {}).items() if key != "config"}
    shapes = parameter_shapes(checkpoint.get("state_dict", {}))
    return {"step": checkpoint.get("global_step"), "lineage": lineage, "parameters": shapes}


def files_under(directory: Path) -> set[Path]:
    return {path for path in directory.rglob("*") if path.is_file()}


def complete_sharded(directory: Path) -> Path:
    """`directory`, refused unless it holds DCP's index and `meta.pt`, and nothing but regular files and folders:
    a pipe in it would block its reader forever, a device never end."""
    fix = f"use another checkpoint in {directory.parent}"
    for entry in [directory / DCP_METADATA, directory / SHARDED_META, *directory.rglob("*")]:
        if entry.name in (DCP_METADATA, SHARDED_META) or not entry.is_dir():
            regular_file(entry, "the sharded checkpoint's file", fix)
    missing = [name for name in (DCP_METADATA, SHARDED_META) if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{directory} is not a complete sharded checkpoint: it has no {' and no '.join(missing)} (DCP's index "
            f"and Lightning's meta.pt are in every one); {fix}"
        )
    return directory


def checkpoint_bytes(path: Path) -> int:
    """The size of a checkpoint file, or the total size of a sharded checkpoint's files."""
    return sum(file.stat().st_size for file in files_under(path)) if path.is_dir() else path.stat().st_size


def listed_files(path: Path, record: dict[str, Any]) -> dict[Path, tuple[int, str]]:
    """Each file of a checkpoint (or of a sharded directory) with the size and SHA-256 its sidecar records."""
    if path.is_dir():
        return {path / name: (entry["bytes"], entry["sha256"]) for name, entry in record["files"].items()}
    return {path: (record["bytes"], record["sha256"])}


def verify(path: Path) -> dict[str, Any]:
    """The sidecar of a complete, intact checkpoint, else a `CheckpointError` naming what is wrong. A file
    verified before in this process, unchanged since, is not read again."""
    path = path.resolve()
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} not found")
    if path.is_dir():
        complete_sharded(path)
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise CheckpointError(
            f"{path} has no sidecar {sidecar.name}, which is written last: its save did not finish, the sidecar was "
            f"not copied with it, or it predates sidecars (such a checkpoint can still be evaluated, not resumed); "
            f"use another checkpoint"
        )
    try:
        record = json.loads(sidecar.read_text())
        written, expected = record["format"], listed_files(path, record)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"sidecar {sidecar} is unreadable ({error!r}); use another checkpoint") from None
    if written != SIDECAR_FORMAT:
        raise CheckpointError(f"sidecar {sidecar} has format {written}, this code reads {SIDECAR_FORMAT}")
    unlisted = sorted(files_under(path) - expected.keys()) if path.is_dir() else []
    if unlisted:
        raise CheckpointError(
            f"{unlisted[0]} is not listed in the sidecar {sidecar.name}: something wrote into the checkpoint after "
            f"its save; use another checkpoint in {path.parent}"
        )
    for file, (size, sha) in expected.items():
        verify_file(file, size, sha, path.parent)
    return record


def verify_file(file: Path, expected_bytes: int, expected_sha: str, checkpoints: Path) -> None:
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing: the checkpoint is incomplete; use another checkpoint in {checkpoints}"
        )
    stat = file.stat()
    if stat.st_size != expected_bytes:
        raise CheckpointError(
            f"{file} has {stat.st_size} bytes, its sidecar says {expected_bytes}: it is truncated or altered; "
            f"use another checkpoint in {checkpoints}"
        )
    key = (file, stat.st_size, stat.st_mtime_ns, expected_sha)
    if key not in _verified:
        if sha256_of(file) != expected_sha:
            raise CheckpointError(
                f"{file} does not match the SHA-256 in its sidecar: it is corrupt; "
                f"use another checkpoint in {checkpoints}"
            )
        _verified.add(key)


_verified: set[tuple[Path, int, int, str]] = set()
