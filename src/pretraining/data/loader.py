"""The DataLoaders of the DataModule: training batches timed for the data wait, workers that leave stop
signals to the main process, memory pinned where a GPU can use it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from pretraining.errors import PretrainingError


def leave_stop_signals_to_the_main_process(worker_id: int) -> None:
    """In a DataLoader worker, ignore SIGTERM, SIGUSR1 and SIGINT. A scheduler (or Ctrl-C) signals
    every process of the job; a worker that died of it would crash the run before the main process
    reaches the step boundary where it saves (`Preemption`). The main process shuts its workers down
    afterwards, and a worker still exits if the main process dies."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


class WaitTimedLoader(DataLoader):
    """A DataLoader that adds up, in `waited`, the seconds its consumer spends blocked on the next batch:
    the training loop's data wait (`pretraining.callbacks.Throughput` reports its share of step time).
    Only the host clock is read, so timing costs no device sync."""

    waited = 0.0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # consumers only call next()
        return self._timed(super().__iter__())

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            except PretrainingError as error:
                message = worker_message(error)
                if message is None:
                    raise
                raise type(error)(message) from error
            self.waited += time.perf_counter() - start
            yield batch


def worker_message(error: PretrainingError) -> str | None:
    """The message of our `error` as a DataLoader worker raised it, or None if no worker did: torch raises
    it again in the main process with the worker's traceback in its message, but our messages stand
    alone (HYDRA_FULL_ERROR=1 shows that traceback, chained)."""
    text, raised = str(error), f"{type(error).__module__}.{type(error).__qualname__}: "
    if not text.startswith("Caught ") or raised not in text:
        return None
    return text.rpartition(raised)[2].strip()


def training_loader(stream: Dataset, num_workers: int, pin_memory: bool | None) -> WaitTimedLoader:
    """The loader of a rank's training stream, which yields whole micro-batches."""
    return WaitTimedLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pinned(pin_memory),
        persistent_workers=num_workers > 0,
        worker_init_fn=leave_stop_signals_to_the_main_process,
    )


def validation_loader(examples: list[Any], batch_size: int, pin_memory: bool | None) -> DataLoader:
    """The loader of a rank's validation examples, read in the main process (they are in memory)."""
    return DataLoader(examples, batch_size=batch_size, num_workers=0, pin_memory=pinned(pin_memory))  # type: ignore[arg-type]


def pinned(pin_memory: bool | None) -> bool:
    """Pinned host memory lets the copy to the GPU overlap compute (Lightning copies non-blocking);
    None: pinned when a GPU is present."""
    return torch.cuda.is_available() if pin_memory is None else pin_memory
