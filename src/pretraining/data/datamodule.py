"""LightningDataModules over a shard directory with a manifest: packed text blocks or text pairs.

The DataModule also owns the training data position. It sees every batch the
training loop consumes (`on_before_batch_transfer`, which runs on consumed
batches, not on the ones the loop prefetches) and keeps, per DataLoader
worker, the cursor where that worker's stream continues, plus the number of
batches consumed. `state_dict()` gathers this from every rank, so rank zero's
checkpoint holds all of them, and `train_dataloader()` always starts from it:
after a restore, each worker skips its finished shards by arithmetic and
re-reads only its current shard.
"""

from __future__ import annotations

import os
import signal
import warnings
from functools import cached_property
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from pretraining.data.shards import Manifest, ShardError
from pretraining.data.stream import (
    Cursor,
    ExampleFormat,
    PackedBlocks,
    ShardStream,
    Tensors,
    TokenizedPairs,
    validation_examples,
)
from pretraining.data.tokenizer import Tokenizer
from pretraining.distributed import gather


def leave_stop_signals_to_the_main_process(worker_id: int) -> None:
    """In a DataLoader worker, ignore SIGTERM, SIGUSR1 and SIGINT. A scheduler (or Ctrl-C) signals
    every process of the job; a worker that died of it would crash the run before the main process
    reaches the step boundary where it saves (`Preemption`). The main process shuts its workers down
    afterwards, and a worker still exits if the main process dies."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def check_minimums(**values: tuple[int, int]) -> None:
    """Raise naming the `data.` key of any value below its minimum."""
    for key, (value, minimum) in values.items():
        if value < minimum:
            raise ValueError(f"data.{key}={value} must be at least {minimum}")


class ShardDataModule(LightningDataModule):
    """Examples streamed from WebDataset shards; subclasses say which (`format`).

    Training is an infinite `ShardStream` per rank (train with `max_steps`).
    Validation is the first `val_size` examples of the validation shards, dealt
    to ranks in equal numbers, the same every time.
    """

    STATE_FORMAT = 1

    def __init__(
        self,
        dir: str,
        tokenizer: Tokenizer,
        format: ExampleFormat[Any],
        batch_size: int,
        seed: int = 0,
        num_workers: int = 1,
        shuffle_buffer: int = 4096,
        val_size: int = 64,
        val_batch_size: int | None = None,
        verify_checksums: bool = True,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        check_minimums(
            batch_size=(batch_size, 1),
            num_workers=(num_workers, 0),
            shuffle_buffer=(shuffle_buffer, 1),
            val_size=(val_size, 1),
        )
        self.manifest = Manifest.load(dir, verify_checksums=verify_checksums)
        if self.manifest.fields != format.fields:
            raise ShardError(
                f"{dir} holds samples with fields {list(self.manifest.fields)}, but {type(self).__name__} reads "
                f"{list(format.fields)}: point data.dir at shards built for it (`pretrain-data build --pairs` "
                f"makes pairs) or choose the data config that matches these shards"
            )
        self.tokenizer, self.format = tokenizer, format
        self.batch_size, self.seed = batch_size, seed
        self.num_workers, self.shuffle_buffer, self.pin_memory = num_workers, shuffle_buffer, pin_memory
        self.val_size, self.val_batch_size = val_size, val_batch_size or batch_size
        # Workers already tokenize in parallel; Rust threads in forked workers can hang.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.batches_consumed = 0  # training batches this rank has consumed
        self.cursors = [Cursor()] * self.workers  # where each worker's stream continues

    @property
    def workers(self) -> int:
        """Streams per rank: one per DataLoader worker (`num_workers=0` reads one in the main process)."""
        return max(1, self.num_workers)

    def topology_for(self, world_size: int) -> dict[str, int]:
        """What the data position depends on besides the cursors: the same values give the same
        batches (the example lengths and the shuffle buffer decide what a shard's n-th example is)."""
        return {
            "world_size": world_size,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            **self.format.lengths,
        }

    @property
    def topology(self) -> dict[str, int]:
        return self.topology_for(self.rank_and_world[1])

    @property
    def kind(self) -> str:
        """What the examples are ("blocks" or "pairs"); objectives declare which they need."""
        return self.format.kind

    @property
    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        """The training stream of this rank, continuing from the data position."""
        rank, world_size = self.rank_and_world
        urls = self.manifest.urls("train")
        first_worker = self.batches_consumed % self.workers  # the worker whose batch comes next
        stream = ShardStream(
            urls, self.format, self.seed, rank, world_size, self.shuffle_buffer, self.cursors, first_worker
        )
        return self._loader(stream, self.batch_size, self.num_workers, leave_stop_signals_to_the_main_process)

    def on_before_batch_transfer(self, batch: Tensors, dataloader_idx: int) -> Tensors:
        if "cursor" in batch:  # a training batch (validation has none): it advances the position
            worker = int(batch.pop("worker")[0])  # a batch comes whole from one worker
            self.cursors[worker] = Cursor(*batch.pop("cursor")[-1].tolist())
            self.batches_consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The data position of every rank (a collective under DDP/FSDP: every rank calls it on save)."""
        position = {"batches_consumed": self.batches_consumed, "cursors": [[c.shard, c.block] for c in self.cursors]}
        return {
            "format": self.STATE_FORMAT,
            "data_version": self.manifest.version,
            "topology": self.topology,
            "ranks": gather(position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: exactly if the topology is unchanged, else approximately
        (the caller decides whether a change is allowed: see `pretraining.resume`)."""
        if state.get("format") != self.STATE_FORMAT:
            raise ValueError(
                f"the checkpoint's data position has format {state.get('format')}, this code reads "
                f"{self.STATE_FORMAT}: resume it with the code revision that wrote it"
            )
        rank, world_size = self.rank_and_world
        if state["data_version"] != self.manifest.version:
            warnings.warn("the data changed since the checkpoint: the new data is read from its start", stacklevel=1)
            self.batches_consumed = state["ranks"][0]["batches_consumed"]
            return
        if state["topology"] == self.topology:
            position = state["ranks"][rank]
            self.batches_consumed = position["batches_consumed"]
            self.cursors = [Cursor(*cursor) for cursor in position["cursors"]]
            return
        # Every worker starts at the same ordinal: the shards the old run finished, counted over all its
        # workers, shared out among the new ones (rounded up). Approximate: a shard in progress then
        # may be skipped or read again from its start.
        done = sum(cursor[0] for position in state["ranks"] for cursor in position["cursors"])
        start = Cursor(-(-done // (world_size * self.workers)))
        warnings.warn(
            f"data topology changed from {state['topology']} to {self.topology}: the stream resumes approximately, "
            f"at shard {start.shard} of every worker, after about {done} shards",
            stacklevel=1,
        )
        self.batches_consumed = state["ranks"][0]["batches_consumed"]
        self.cursors = [start] * self.workers

    @cached_property
    def validation_set(self) -> list[Tensors]:
        """All ranks' validation examples, read once however often validation runs."""
        return validation_examples(self.manifest.urls("validation"), self.format, self.val_size)

    def val_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world
        examples = self.validation_set
        per_rank = len(examples) // world_size
        if per_rank == 0:
            fix = "lower data.block_size or " if self.kind == "blocks" else ""
            raise ValueError(
                f"the validation shards give {len(examples)} {self.kind}, fewer than {world_size} ranks; "
                f"{fix}build the shards with a larger --validation-fraction"
            )
        # Equal counts on every rank: unequal ones deadlock the metric reduction.
        return self._loader(examples[rank::world_size][:per_rank], self.val_batch_size, 0)

    def _loader(self, dataset, batch_size: int, num_workers: int, worker_init_fn=None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=num_workers > 0,
            worker_init_fn=worker_init_fn,
        )


class BlockDataModule(ShardDataModule):
    """Packed blocks of `block_size + 1` tokens from text shards (next-token and masked-LM)."""

    def __init__(self, dir: str, tokenizer: Tokenizer, block_size: int, batch_size: int, **options: Any) -> None:
        check_minimums(block_size=(block_size, 1))
        super().__init__(dir, tokenizer, PackedBlocks(tokenizer, block_size), batch_size, **options)
        self.block_size = block_size


class PairDataModule(ShardDataModule):
    """(query, passage) pairs from pair shards, each side truncated to its own length (contrastive)."""

    def __init__(
        self, dir: str, tokenizer: Tokenizer, query_len: int, passage_len: int, batch_size: int, **options: Any
    ) -> None:
        # Two tokens at least: CLS and one of the text.
        check_minimums(query_len=(query_len, 2), passage_len=(passage_len, 2))
        super().__init__(dir, tokenizer, TokenizedPairs(tokenizer, query_len, passage_len), batch_size, **options)
        self.query_len, self.passage_len = query_len, passage_len
