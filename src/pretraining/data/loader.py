"""The DataModule's loaders: training batches timed for the data wait, sent by the workers several to a
message in one buffer (torch's transport sends each tensor through a file descriptor of its own, fetched
over a new connection: docs/benchmarks.md), workers that leave stop signals to the main process."""

from __future__ import annotations

import collections
import ctypes
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def set_up_worker(worker_id: int) -> None:
    """The `worker_init_fn` of the training loader."""
    leave_stop_signals_to_the_main_process()
    end_with_the_main_process()


def leave_stop_signals_to_the_main_process() -> None:
    """Ignore stop signals in a worker: one dying of a scheduler's signal would crash the run before the main
    process saves at the step boundary (`Preemption`)."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_the_main_process() -> None:
    """Have this worker killed when the main process dies: torch's watch ends only an idle worker, and one
    blocked sending a batch would stay for good (its siblings hold the pipe open). On Linux the kernel kills it
    when the forking thread (the training loop's, the main thread) ends; elsewhere a thread of the worker watches."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if main_process_died():  # before the prctl: no signal will come
            os._exit(1)
    else:
        threading.Thread(target=exit_when_the_main_process_dies, daemon=True).start()


def exit_when_the_main_process_dies() -> None:
    while not main_process_died():
        time.sleep(1)
    os._exit(1)


def main_process_died() -> bool:
    """Whether the process that started this worker has died."""
    main = multiprocessing.parent_process()
    assert main is not None, "called in a worker"
    if multiprocessing.get_start_method() == "fork":
        # Later siblings hold open the pipe `is_alive` watches; an orphan gets a new parent at once.
        return os.getppid() != main.pid
    return not main.is_alive()  # a forkserver is the parent, not the main process


class TensorSpec(NamedTuple):
    """Where a tensor lies in a `OneBuffer`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


# Every dtype's element size divides it, so each tensor is read from the buffer as a view.
ALIGNMENT = 16
# A buffer below this size crosses in the pipe, by value: faster there than in shared memory.
IN_THE_PIPE_BELOW = 256 * 1024
# Each message costs the main process the same whatever its size; more batches to one would delay the first step.
BATCHES_PER_MESSAGE = 8


@dataclass(frozen=True)
class OneBuffer:
    """Batches as a worker sends them: all their tensors copied into one byte buffer, which crosses once (a
    small one by value in the pipe). `fields` maps each key of each batch to its tensor's place or its value."""

    buffer: torch.Tensor
    fields: tuple[dict[str, TensorSpec | Any], ...]

    def __reduce__(self) -> tuple[Any, ...]:  # how a worker sends it
        small = self.buffer.nbytes < IN_THE_PIPE_BELOW
        return received, (self.buffer.numpy() if small else self.buffer, self.fields)

    def pin_memory(self) -> OneBuffer:  # the DataLoader's pinning thread calls this
        return replace(self, buffer=self.buffer.pin_memory())

    def batches(self) -> list[dict[str, Any]]:
        return [
            {name: self.tensor(field) if isinstance(field, TensorSpec) else field for name, field in fields.items()}
            for fields in self.fields
        ]

    def tensor(self, spec: TensorSpec) -> torch.Tensor:
        size = spec.dtype.itemsize * torch.Size(spec.shape).numel()
        return self.buffer[spec.offset : spec.offset + size].view(spec.dtype).view(spec.shape)


def received(buffer: torch.Tensor | np.ndarray, fields: tuple[dict[str, TensorSpec | Any], ...]) -> OneBuffer:
    return OneBuffer(torch.as_tensor(buffer), fields)


def in_one_buffer(batches: list[Any]) -> OneBuffer | list[Any]:
    """Batches of dense CPU tensors and plain values as a `OneBuffer`; any others as they are."""
    if not all(map(packable, batches)):
        return batches
    fields: list[dict[str, TensorSpec | Any]] = []
    size = 0
    for batch in batches:
        fields.append({})
        for name, value in batch.items():
            if isinstance(value, torch.Tensor):
                fields[-1][name] = TensorSpec(value.dtype, tuple(value.shape), size)
                size += aligned(value.nbytes)
            else:
                fields[-1][name] = value
    packed = OneBuffer(torch.empty(size, dtype=torch.uint8), tuple(fields))
    for batch, specs in zip(batches, fields, strict=True):
        for name, value in batch.items():
            if isinstance(value, torch.Tensor):
                packed.tensor(specs[name]).copy_(value)
    return packed


def packable(batch: Any) -> bool:
    return isinstance(batch, dict) and all(map(packable_value, batch.values()))


def packable_value(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout == torch.strided and value.device.type == "cpu" and not value.is_quantized
    return isinstance(value, int | float | str | bool | None)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class StreamEnded:
    """Where a worker's stream ended."""


@dataclass(frozen=True)
class WorkerError:
    """The error a worker's stream raised, pickled with the worker's traceback as a note. The main process
    raises a fresh copy (`raised`): a reference cycle through a held one would keep the workers alive until a
    garbage collection."""

    pickled: bytes

    @classmethod
    def of(cls, error: Exception, worker: int) -> WorkerError:
        error.add_note(f"in DataLoader worker process {worker}:\n{traceback.format_exc()}")
        try:
            pickled = pickle.dumps(error)
            pickle.loads(pickled)
            return cls(pickled)
        except Exception:  # an error that does not cross whole crosses as its message
            return cls(pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}\n{error.__notes__[-1]}")))

    def raised(self) -> Exception:
        return pickle.loads(self.pickled)


@dataclass(frozen=True)
class Message:
    """What a worker sends: its next batches, and `end` if its stream stops after them (a `StreamEnded`, or
    the error to raise where its next batch would have been)."""

    worker: int
    batches: OneBuffer | list[Any]
    end: StreamEnded | WorkerError | None = None

    def unpacked(self) -> list[Any]:
        batches = self.batches.batches() if isinstance(self.batches, OneBuffer) else self.batches
        return batches if self.end is None else [*batches, self.end]


def in_one_message(message: Message) -> Message:
    """The workers' `collate_fn`: the message, its batches in one buffer where they pack."""
    assert isinstance(message.batches, list), "packed already"
    return replace(message, batches=in_one_buffer(message.batches))


class InMessages(IterableDataset):
    """A worker's batches in `Message`s of as many as fit in the pipe, at most `BATCHES_PER_MESSAGE`;
    `WaitTimedLoader` deals them out again in order."""

    def __init__(self, batches: IterableDataset) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Message]:
        info = get_worker_info()
        worker = info.id if info else 0
        batches = iter(self.batches)
        while True:
            made: list[Any] = []
            try:
                made.append(next(batches))
                for batch in itertools.islice(batches, per_message(made[0]) - 1):
                    made.append(batch)  # one by one: those made before an error are sent before it
            except StopIteration:
                yield Message(worker, made, end=StreamEnded())
                return
            except Exception as error:
                yield Message(worker, made, end=WorkerError.of(error, worker))
                return
            yield Message(worker, made)


def per_message(batch: Any) -> int:
    """How many batches like `batch` a message holds: as many as one buffer takes in the pipe."""
    if not packable(batch):
        return 1  # its tensors cross one by one, in shared memory
    size = sum(aligned(value.nbytes) for value in batch.values() if isinstance(value, torch.Tensor))
    return max(1, min(BATCHES_PER_MESSAGE, (IN_THE_PIPE_BELOW - 1) // max(size, 1)))


def dealt(messages: Iterator[Message], workers: int) -> Iterator[Any]:
    """The messages' batches in the order the workers made them (worker `w` makes `w`, `w + workers`, ...);
    a worker's end or error ends them where its next batch would have been."""
    made_by: list[collections.deque[Any]] = [collections.deque() for _ in range(workers)]
    for batches in itertools.cycle(made_by):
        while not batches:
            message = next(messages, None)
            if message is None:
                return
            made_by[message.worker].extend(message.unpacked())
        batch = batches.popleft()
        if isinstance(batch, StreamEnded):
            return
        if isinstance(batch, WorkerError):
            raise batch.raised()
        yield batch


class WaitTimedLoader(DataLoader):
    """A DataLoader that adds up in `waited` the seconds its consumer blocks on the next batch (reported by
    `pretraining.callbacks.throughput.Throughput`; host clock only, so no device sync)."""

    waited = 0.0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # consumers only call next()
        batches: Iterator[Any] = super().__iter__()
        if isinstance(self.dataset, InMessages):
            batches = dealt(batches, max(self.num_workers, 1))
        return self._timed(batches)

    def _timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waited += time.perf_counter() - start
            yield batch


def training_loader(stream: IterableDataset, num_workers: int, pin_memory: bool | None) -> WaitTimedLoader:
    """The loader of a rank's training stream (endless), which yields whole micro-batches."""
    return WaitTimedLoader(
        InMessages(stream) if num_workers > 0 else stream,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pinned(pin_memory),
        persistent_workers=num_workers > 0,
        collate_fn=in_one_message if num_workers > 0 else None,  # type: ignore[arg-type]  # called on each item
        worker_init_fn=set_up_worker,
    )


def validation_loader(examples: list[Any], batch_size: int, pin_memory: bool | None) -> DataLoader:
    """The loader of a rank's validation examples, read in the main process (they are in memory)."""
    return DataLoader(examples, batch_size=batch_size, num_workers=0, pin_memory=pinned(pin_memory))  # type: ignore[arg-type]


def pinned(pin_memory: bool | None) -> bool:
    """Pinned memory lets the copy to the GPU overlap compute; None: pinned when a GPU is present."""
    return torch.cuda.is_available() if pin_memory is None else pin_memory
