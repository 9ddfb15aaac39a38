"""A shard's bytes hashed as they are read: `Digest`, for `pretrain-data index` (the sha256 and size of a
shard in the pass that counts its samples) and for the start-up check of a remote shard's checksum (the only
use a training run has for it, so that it loads this module only then)."""

from __future__ import annotations

import hashlib
from typing import Any


class Digest:
    """A binary stream read through, hashing and counting its bytes (a shard's sha256 and size in the
    same pass that reads its samples)."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256, self.bytes = file, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def __enter__(self) -> Digest:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        while error is None and self.read(1 << 20):  # all of it, whatever its reader left (a gzip trailer)
            pass
        self.file.close()  # a `pipe:` command's exit status is checked here
