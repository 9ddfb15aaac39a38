"""Replace a dataset directory whole: a dataset is written into a staging directory beside it and swapped in
once complete, so a crash or a full disk never leaves a half-written shard or manifest where a good one was."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pretraining.data.manifest import MANIFEST, TOKENIZER
from pretraining.errors import ShardError


def write_directory(out_dir: Path, write: Callable[[Path], dict], keep_tokenizer: bool = True) -> dict:
    """Replace `out_dir` by the dataset `write` writes into an empty staging directory (returning its manifest),
    whole once it is written: a failure leaves `out_dir` as it was and nothing half-written. `keep_tokenizer`:
    a tokenizer.json trained in `out_dir` stays (a rebuild keeps it); else `write`'s own, if any."""
    out_dir = out_dir.resolve()
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise ShardError(f"{out_dir} is not empty and holds no {MANIFEST}; choose a new or empty --out directory")
    if (out_dir / MANIFEST).is_file() and json.loads((out_dir / MANIFEST).read_bytes()).get("indexed"):
        raise ShardError(
            f"{out_dir} holds the manifest of shards indexed with `pretrain-data index`, and a build replaces the "
            f"whole directory, shards included: choose a new or empty --out directory"
        )
    staging = out_dir.with_name(f".{out_dir.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        manifest = write(staging)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)  # out_dir keeps the previous good dataset
        if isinstance(error, OSError):  # a full disk, a directory that cannot be written
            raise ShardError(
                f"writing the shards failed: {error}; {out_dir} is unchanged and nothing half-written was left: "
                f"free space (or choose another --out) and build again"
            ) from error
        raise
    _swap_in(staging, out_dir, keep_tokenizer)
    return manifest


def _swap_in(staging: Path, out_dir: Path, keep_tokenizer: bool) -> None:
    """Replace `out_dir` by the finished `staging` directory, keeping a tokenizer trained there if asked."""
    if keep_tokenizer and (out_dir / TOKENIZER).is_file():
        shutil.copy2(out_dir / TOKENIZER, staging / TOKENIZER)
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)
