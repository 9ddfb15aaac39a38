"""The LightningDataModule over a shard directory with a manifest."""

from __future__ import annotations

import os
from functools import cached_property

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from pretraining.data.shards import Manifest
from pretraining.data.stream import ShardStream, validation_blocks
from pretraining.data.tokenizer import Tokenizer


class ShardDataModule(LightningDataModule):
    """Packed token blocks from WebDataset shards.

    Training is an infinite `ShardStream` per rank (train with `max_steps`).
    Validation is the first `val_blocks` blocks of the validation shards, dealt
    to ranks in equal numbers, the same every time.
    """

    def __init__(
        self,
        dir: str,
        tokenizer: Tokenizer,
        block_size: int,
        batch_size: int,
        seed: int = 0,
        num_workers: int = 1,
        shuffle_buffer: int = 4096,
        val_blocks: int = 64,
        val_batch_size: int | None = None,
        verify_checksums: bool = True,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        for key, value, minimum in [
            ("block_size", block_size, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("shuffle_buffer", shuffle_buffer, 1),
            ("val_blocks", val_blocks, 1),
        ]:
            if value < minimum:
                raise ValueError(f"data.{key}={value} must be at least {minimum}")
        self.manifest = Manifest.load(dir, verify_checksums=verify_checksums)
        self.tokenizer = tokenizer
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        self.num_workers, self.shuffle_buffer, self.pin_memory = num_workers, shuffle_buffer, pin_memory
        self.val_blocks, self.val_batch_size = val_blocks, val_batch_size or batch_size
        # Workers already tokenize in parallel; Rust threads in forked workers can hang.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    @property
    def rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world
        stream = ShardStream(
            self.manifest.urls("train"),
            self.tokenizer,
            self.block_size,
            self.seed,
            rank,
            world_size,
            self.shuffle_buffer,
        )
        return self._loader(stream, self.batch_size, self.num_workers)

    @cached_property
    def validation_set(self) -> list[dict]:
        """All ranks' validation blocks, read once however often validation runs."""
        return validation_blocks(self.manifest.urls("validation"), self.tokenizer, self.block_size, self.val_blocks)

    def val_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world
        blocks = self.validation_set
        per_rank = len(blocks) // world_size
        if per_rank == 0:
            raise ValueError(
                f"the validation shards give {len(blocks)} blocks of {self.block_size} tokens, fewer than "
                f"{world_size} ranks; lower data.block_size or build with a larger validation fraction"
            )
        # Equal counts on every rank: unequal ones deadlock the metric reduction.
        return self._loader(blocks[rank::world_size][:per_rank], self.val_batch_size, 0)

    def _loader(self, dataset, batch_size: int, num_workers: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=num_workers > 0,
        )
