"""The DataLoaders of the DataModule: training batches timed for the data wait, sent from the workers
several to a message in one buffer, workers that leave stop signals to the main process, memory pinned
where a GPU can use it.

Not torch's own worker-to-main transport for the training batches: it sends each tensor of a batch
through a file descriptor of its own, which the main process fetches over a new connection to the worker,
and one message per batch (docs/benchmarks.md has the costs measured on a CPU)."""

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
    """In a DataLoader worker, ignore SIGTERM, SIGUSR1 and SIGINT. A scheduler (or Ctrl-C) signals
    every process of the job; a worker that died of it would crash the run before the main process
    reaches the step boundary where it saves (`Preemption`). The main process shuts its workers down
    afterwards, and a worker still ends if the main process dies (`end_with_the_main_process`)."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_the_main_process() -> None:
    """Have this DataLoader worker killed when the main process dies. torch's own watch on the parent
    ends only a worker that waits for work: after a SIGKILL of the main process, a worker with a batch still
    to send stays blocked writing to its pipe for good (its siblings hold the pipe's other end open), with
    the run's files open, and it ignores stop signals. On Linux the kernel sends the SIGKILL when the
    thread that forked the worker ends: the DataLoader forks its workers from the training loop's thread,
    the main thread. Elsewhere a thread of the worker watches."""
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
        # Its siblings forked later hold the pipe that `is_alive` watches open too; a dead parent's
        # children have a new parent at once.
        return os.getppid() != main.pid
    return not main.is_alive()  # a forkserver is the parent, not the main process


class TensorSpec(NamedTuple):
    """Where a tensor lies in a `OneBuffer`."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


# Every dtype's element size divides it, so each tensor is read from the buffer as a view.
ALIGNMENT = 16
# A buffer below this size crosses in the pipe, by value (faster there than in shared memory up to about
# 1 MB, on a CPU).
IN_THE_PIPE_BELOW = 256 * 1024
# A message holds as many batches as its buffer can take below `IN_THE_PIPE_BELOW`, up to this many: each
# message costs the main process the same whatever its size (the queue, unpickling, asking the worker for
# the next); more batches to a message would only delay the first step.
BATCHES_PER_MESSAGE = 8


@dataclass(frozen=True)
class OneBuffer:
    """Batches as a worker sends them: all their tensors copied into one byte buffer. A tensor sent from a
    worker crosses in shared memory, and the main process then fetches its file descriptor over a new,
    authenticated connection to the worker, one tensor at a time. One buffer crosses once, and a small one by
    value in the pipe, with no descriptor. `fields` maps each key of each batch, in the batch's order, to its
    tensor's place in the buffer or to its value."""

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
    """Batches that are dicts of dense CPU tensors and plain values (numbers, strings) as a `OneBuffer`;
    any others (nested tensors, sparse ones) as they are."""
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
    """The error a worker's stream raised, as it crosses to the main process: pickled, with the worker's
    traceback as a note. The main process raises a fresh copy (`raised`), which no frame of the loader holds:
    a reference cycle through it would keep the workers alive until a garbage collection, which then waits
    5 s for each."""

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
    """What a DataLoader worker sends: its next batches (in one buffer where they pack), and whether its
    stream stops after them: `end` is a `StreamEnded`, or the error the stream raised instead of its next
    batch, to be raised where that batch would have been."""

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
    """A stream of batches as each DataLoader worker sends it: in `Message`s of as many consecutive batches
    as fit in the pipe (`IN_THE_PIPE_BELOW`), at most `BATCHES_PER_MESSAGE`. `WaitTimedLoader` deals them
    out again in the order the workers made them."""

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
    """The batches of the messages of `workers` DataLoader workers, dealt out in the order the workers
    made them: worker `w` makes batches `w`, `w + workers`, ... They end where the first worker's stream
    ends, and a worker's error is raised where its failed batch would have been."""
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
    """A DataLoader that adds up, in `waited`, the seconds its consumer spends blocked on the next batch:
    the training loop's data wait (`pretraining.callbacks.throughput.Throughput` reports its share of step time).
    Only the host clock is read, so timing costs no device sync. Over `InMessages`, it deals out the
    batches of its workers' messages."""

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
    """Pinned host memory lets the copy to the GPU overlap compute (Lightning copies non-blocking);
    None: pinned when a GPU is present."""
    return torch.cuda.is_available() if pin_memory is None else pin_memory
