"""Checkpoints written in the background: the step waits only for a host copy of the state.

A writer thread writes the copy as a synchronous save does (`save_file`), so a kill mid-write leaves the
previous checkpoint the newest that verifies. At most one write is in flight: the next save, the end of a
validation and of training wait for it, and a failed write raises there, on the training thread."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def host_copy(state: Any) -> Any:
    """A deep copy of `state` with one host copy per tensor, so nothing the writer reads changes under it;
    containers keep their types and attributes (a state dict's `_metadata`)."""
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
        """The path of the write in flight once done (waiting if `wait`), raising its error; else None."""
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
