"""The DataLoaders of the DataModule: training batches timed for the data wait, sent from the workers in
one buffer, workers that leave stop signals to the main process, memory pinned where a GPU can use it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
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


class TensorSpec(NamedTuple):
    """Where a tensor lies in a `OneBuffer`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


# Every dtype's element size divides it, so each tensor is read from the buffer as a view.
ALIGNMENT = 16
# A buffer below this size crosses in the pipe, by value. Measured on a CPU (a worker's batch received in
# the main process): 0.83 against 1.65 ms in shared memory at 13 KB, 1.23 against 1.48 ms at 260 KB, about
# even at 1 MB, 19 against 3.2 ms at 4 MB.
IN_THE_PIPE_BELOW = 256 * 1024


@dataclass(frozen=True)
class OneBuffer:
    """A batch as a worker sends it: all its tensors copied into one byte buffer. A tensor sent from a
    worker crosses in shared memory, and the main process then fetches its file descriptor over a new,
    authenticated connection to the worker: about 0.6 ms each on a CPU, 4.3 ms for the seven tensors of a
    packed-text batch, 6 % of a small model's step. One buffer crosses once, and a small one by value in
    the pipe, with no descriptor (0.83 ms for that batch). `fields` maps each key, in the batch's order,
    to its tensor's place in the buffer or to its value."""

    buffer: torch.Tensor
    fields: dict[str, TensorSpec | Any]

    def __reduce__(self) -> tuple[Any, ...]:  # how a worker sends it
        small = self.buffer.nbytes < IN_THE_PIPE_BELOW
        return received, (self.buffer.numpy() if small else self.buffer, self.fields)

    def pin_memory(self) -> OneBuffer:  # the DataLoader's pinning thread calls this
        return replace(self, buffer=self.buffer.pin_memory())

    def batch(self) -> dict[str, Any]:
        return {
            name: self.tensor(field) if isinstance(field, TensorSpec) else field for name, field in self.fields.items()
        }

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        size = spec.dtype.itemsize * torch.Size(spec.shape).numel()
        return self.buffer[spec.offset : spec.offset + size].view(spec.dtype).view(spec.shape)


def received(buffer: torch.Tensor | np.ndarray, fields: dict[str, TensorSpec | Any]) -> OneBuffer:
    return OneBuffer(torch.as_tensor(buffer), fields)


def in_one_buffer(batch: Any) -> Any:
    """The workers' `collate_fn`: a dict of dense CPU tensors and plain values (numbers, strings) as a
    `OneBuffer` (`WaitTimedLoader` unpacks it); anything else (nested tensors, sparse ones) as it is."""
    if not isinstance(batch, dict) or not all(map(packable, batch.values())):
        return batch
    fields: dict[str, TensorSpec | Any] = {}
    size = 0
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            fields[name] = TensorSpec(value.dtype, tuple(value.shape), size)
            size += -(-value.nbytes // ALIGNMENT) * ALIGNMENT
        else:
            fields[name] = value
    packed = OneBuffer(torch.empty(size, dtype=torch.uint8), fields)
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            packed.tensor(fields[name]).copy_(value)
    return packed


def packable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout == torch.strided and value.device.type == "cpu" and not value.is_quantized
    return isinstance(value, int | float | str | bool | None)


class WaitTimedLoader(DataLoader):
    """A DataLoader that adds up, in `waited`, the seconds its consumer spends blocked on the next batch:
    the training loop's data wait (`pretraining.callbacks.Throughput` reports its share of step time).
    Only the host clock is read, so timing costs no device sync. It unpacks the batches its workers send
    in one buffer (`in_one_buffer`)."""

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
            if isinstance(batch, OneBuffer):
                batch = batch.batch()
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
        collate_fn=in_one_buffer if num_workers > 0 else None,
        worker_init_fn=leave_stop_signals_to_the_main_process,
    )


def validation_loader(examples: list[Any], batch_size: int, pin_memory: bool | None) -> DataLoader:
    """The loader of a rank's validation examples, read in the main process (they are in memory)."""
    return DataLoader(examples, batch_size=batch_size, num_workers=0, pin_memory=pinned(pin_memory))  # type: ignore[arg-type]


def pinned(pin_memory: bool | None) -> bool:
    """Pinned host memory lets the copy to the GPU overlap compute (Lightning copies non-blocking);
    None: pinned when a GPU is present."""
    return torch.cuda.is_available() if pin_memory is None else pin_memory
