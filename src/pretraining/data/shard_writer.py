"""Size-bounded, byte-reproducible tar shards of one split, each written under a temporary name, fsynced and
renamed into place whole (`pretraining.data.shards` builds a dataset of them)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

from pretraining.data.manifest import ShardInfo
from pretraining.files import sha256_of


def member_bytes(size: int) -> int:
    """A tar member's header plus its data padded to whole blocks."""
    return tarfile.BLOCKSIZE + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def tar_bytes(members_end: int) -> int:
    """The size of a closed tar whose members end at `members_end`: two end blocks, padded to a record."""
    return -(-(members_end + 2 * tarfile.BLOCKSIZE) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class ShardWriter:
    """Writes one split's samples into tar shards of at most `max_bytes` and `max_samples` (a sample larger than
    that alone gets a shard of its own), byte-reproducible: fixed member order, times and modes."""

    def __init__(self, directory: Path, split: str, max_bytes: int, max_samples: int) -> None:
        self.directory, self.split = directory, split
        self.max_bytes, self.max_samples = max_bytes, max_samples
        self.shards: list[ShardInfo] = []
        self._tar: tarfile.TarFile | None = None

    def write(self, key: str, texts: dict[str, str], meta: dict) -> None:
        members = {name: text.encode() for name, text in texts.items()}
        members["json"] = json.dumps(meta, sort_keys=True).encode()
        size = sum(member_bytes(len(data)) for data in members.values())
        if self._tar is None or self._full(size):
            self._finish_shard()
            self._start_shard()
        assert self._tar is not None
        for extension, data in members.items():
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444
            self._tar.addfile(info, io.BytesIO(data))
        self._samples += 1
        self._text_bytes += sum(len(members[name]) for name in texts)

    def close(self) -> list[ShardInfo]:
        self._finish_shard()
        return self.shards

    def _full(self, next_size: int) -> bool:
        assert self._tar is not None
        over_bytes = tar_bytes(self._tar.offset + next_size) > self.max_bytes
        return self._samples > 0 and (over_bytes or self._samples >= self.max_samples)

    def _start_shard(self) -> None:
        self._name = f"{self.split}-{len(self.shards):06d}.tar"
        self._file = (self.directory / (self._name + ".tmp")).open("wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 (open across writes)
        self._samples = self._text_bytes = 0

    def _finish_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        final = self.directory / self._name
        os.replace(self.directory / (self._name + ".tmp"), final)
        self.shards.append(
            ShardInfo(self._name, self._samples, final.stat().st_size, sha256_of(final), self._text_bytes)
        )
        self._tar = None
