"""What a checkpoint says about itself without loading its tensors: its lineage, and the digest naming it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pretraining.checkpoint.sidecar import SHARDED_META, complete_sharded
from pretraining.checkpoint.weights_only import load_weights_only
from pretraining.errors import ConfigError, MissingFileError
from pretraining.files import regular_file

CHECKPOINTS = "logs/train/runs/<run>/checkpoints/"  # where runs keep them


def existing_checkpoint(path: str | Path) -> Path:
    """`path`, refused (naming where runs keep checkpoints) unless it is a file or a sharded directory."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"checkpoint {path} not found; runs keep them in {CHECKPOINTS}")
    if path.is_dir():
        return path
    return regular_file(path, "checkpoint", f"name a checkpoint file or a sharded one's directory ({CHECKPOINTS})")


def lineage_of(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    """The lineage record of a loaded checkpoint, refused if it has none."""
    if "lineage" not in checkpoint:
        raise ConfigError(f"{path} has no lineage record: it was not written by `pretrain`, so its config is unknown")
    return checkpoint["lineage"]


def read_lineage(path: Path) -> dict[str, Any]:
    """The lineage record of a checkpoint file or sharded directory, without loading its tensors."""
    path = existing_checkpoint(path)
    sharded = path.is_dir()  # its meta.pt holds the lineage; the shards are not read
    source = complete_sharded(path) / SHARDED_META if sharded else path
    return lineage_of(load_weights_only(source, mmap=not sharded), path)


def checkpoint_digest(checksums: str | dict[str, str]) -> str:
    """The SHA-256 naming a checkpoint: a file's, or that of a sharded one's {file: SHA-256} (wherever it is)."""
    if isinstance(checksums, str):
        return checksums
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


def sidecar_checksums(sidecar: dict[str, Any]) -> str | dict[str, str]:
    """The SHA-256 a sidecar records: a file's, or each file's of a sharded checkpoint."""
    files = sidecar.get("files")
    return sidecar["sha256"] if files is None else {name: entry["sha256"] for name, entry in files.items()}


def sidecar_digest(sidecar: dict[str, Any]) -> str:
    """`checkpoint_digest` of the checkpoint a verified sidecar describes."""
    return checkpoint_digest(sidecar_checksums(sidecar))
