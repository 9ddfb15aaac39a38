"""Files that are whole or absent: written under a temporary name beside the final one, fsynced, renamed into place,
the directory fsynced, so a failed write (full disk, crash) leaves the previous file and no temporary. Checkpoints,
sidecars, manifests, tokenizers, run records and reports are written so. `regular_file` guards files a user names;
`open_to_append` the files a run appends to (a record, its log), where a link is refused too."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from pretraining.errors import MissingFileError


def regular_file(path: Path, what: str, fix: str) -> Path:
    """`path`, refused (naming `what` it should be, and `fix`) if something other than a regular file is there, links
    followed: a pipe would block its reader forever, a device never end. A missing file is the caller's to report."""
    if path.exists() and not path.is_file():
        kinds = {"a directory": path.is_dir(), "a named pipe": path.is_fifo(), "a socket": path.is_socket()}
        kind = next((kind for kind, found in kinds.items() if found), "a device")
        raise MissingFileError(f"{what} {path} is {kind}, not a file: {fix}")
    return path


def appendable_file(path: Path, what: str, fix: str) -> Path:
    """`path`, refused as `regular_file` refuses, and if it is a symbolic link: a file a run appends to grows where
    the run keeps it, not wherever a link (copied, or planted) points."""
    if path.is_symlink():
        raise MissingFileError(f"{what} {path} is a symbolic link, not a file: {fix}")
    return regular_file(path, what, fix)


def open_to_append(path: Path, what: str, fix: str) -> io.TextIOWrapper:
    """`path` (made if missing) opened to append text, refused as `appendable_file` refuses. A link or a pipe put there
    after the check fails to open rather than being written through or blocking."""
    appendable_file(path, what, fix)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    return os.fdopen(os.open(path, flags, 0o666), "a")


class RunLogFile(logging.FileHandler):
    """The run's log file (`hydra.job_logging`'s file handler, configs/hydra/default.yaml), opened by
    `open_to_append` at the first line logged. Where it refuses the path, the run says so and logs to its console
    only: Hydra's own handler would block on a pipe there and append through a link, and an error raised here would
    reach the console as Hydra's traceback."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None, delay: bool = False) -> None:
        super().__init__(filename, mode, encoding, delay=True)
        self.refusal: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None and self.refusal is None:
            try:
                self.stream = open_to_append(Path(self.baseFilename), "the run's log file", "remove it")
            except OSError as refusal:  # what open_to_append refuses, or a name the file system does not take
                self.refusal = refusal
                sys.stderr.write(f"warning: {refusal}; this run logs to its console only\n")
        if self.refusal is None:
            super().emit(record)


def temporary_path(path: Path) -> Path:
    """A fresh hidden name beside `path`, to write it under before the rename (pruning deletes leftovers)."""
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:16]}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Any, stale: Path | None = None) -> str:
    """Write `path` through `write(file)` under a temporary name, fsync, rename, fsync the directory; return the
    SHA-256 read back before the rename. `stale` (a sidecar vouching for the old `path`) is deleted just before the
    rename, so a failed write leaves both as they were."""
    temporary = temporary_path(path)
    try:
        with temporary.open("wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        digest = sha256_of(temporary)
        if stale is not None:
            stale.unlink(missing_ok=True)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return digest


def write_atomically(path: Path, data: bytes) -> None:
    """`write_durably` for bytes at hand."""
    write_durably(path, lambda file: file.write(data))
