"""LightningDataModules over a shard directory with a manifest: packed text blocks or text pairs."""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from pretraining.data.shards import Manifest, ShardError
from pretraining.data.stream import (
    ExampleFormat,
    PackedBlocks,
    ShardStream,
    Tensors,
    TokenizedPairs,
    validation_examples,
)
from pretraining.data.tokenizer import Tokenizer


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

    @property
    def kind(self) -> str:
        """What the examples are ("blocks" or "pairs"); objectives declare which they need."""
        return self.format.kind

    @property
    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world
        urls = self.manifest.urls("train")
        stream = ShardStream(urls, self.format, self.seed, rank, world_size, self.shuffle_buffer)
        return self._loader(stream, self.batch_size, self.num_workers)

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

    def _loader(self, dataset, batch_size: int, num_workers: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=num_workers > 0,
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
