"""Corpus readers, shard builder, tokenizers, the resumable shard stream and the DataModule."""

from pretraining.data.datamodule import BlockDataModule, PairDataModule, ShardDataModule, WaitTimedLoader
from pretraining.data.tokenizer import BPETokenizer, ByteTokenizer

__all__ = ["BPETokenizer", "BlockDataModule", "ByteTokenizer", "PairDataModule", "ShardDataModule", "WaitTimedLoader"]
