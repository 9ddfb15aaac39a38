"""Checkpoints written in the background: the step waits only for a host copy of the state.

As torchtitan and OLMo-core do, every tensor of the checkpoint is copied to host memory and a writer
thread writes the copy while training goes on. The thread writes it as a synchronous save does
(`save_file`: temporary file, fsync, read-back SHA-256, rename, sidecar last), so a kill at any moment
of the write leaves the previous checkpoint the newest that verifies. At most one write is in flight:
the next save, the end of a validation (which records its metrics in the sidecar) and the end of
training wait for it, and a write that failed raises its error there, on the training thread.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def host_copy(state: Any) -> Any:
    """A deep copy of `state` whose tensors are copies in host memory (one per tensor, however often it is
    referred to): nothing the writer reads can change while training goes on. Containers keep their types
    and attributes (a state dict's `_metadata`)."""
    copies: dict[int, Any] = {}

    def find_tensors(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in copies:
                copies[id(value)] = value.detach().to("cpu", copy=True)
        elif isinstance(value, Mapping):
            for item in value.values():
                find_tensors(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                find_tensors(item)

    find_tensors(state)
    return copy.deepcopy(state, memo=copies)  # the memo makes deepcopy take each tensor's host copy


class BackgroundWriter:
    """One writer thread (started with the first write) and the write in flight on it, if any."""

    def __init__(self) -> None:
        self.executor: ThreadPoolExecutor | None = None
        self.pending: tuple[Path, Future[None]] | None = None

    def submit(self, path: Path, write: Callable[[], None]) -> None:
        """Start writing `path` with `write()`; the write before must have been collected (`finished`)."""
        assert self.pending is None, "a checkpoint write is still in flight"
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self.pending = path, self.executor.submit(write)

    def close(self) -> None:
        """End the thread (after the write in flight: `finished` reports it)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None

    @property
    def in_flight(self) -> Path | None:
        return self.pending[0] if self.pending else None

    def finished(self, wait: bool) -> Path | None:
        """The path of the write in flight once it is done (waiting for it if `wait`), raising the error it
        failed with; None while it runs (not waiting) or when none is in flight."""
        if self.pending is None:
            return None
        path, future = self.pending
        if not (wait or future.done()):
            return None
        try:
            future.result()
        finally:
            if future.done():  # an interrupt while waiting leaves the write in flight, to be collected again
                self.pending = None
        return path
