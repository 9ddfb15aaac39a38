"""Corpus readers, shard builder, tokenizers, the resumable shard stream and the DataModule."""

from pretraining.data.datamodule import ShardDataModule
from pretraining.data.tokenizer import BPETokenizer, ByteTokenizer

__all__ = ["BPETokenizer", "ByteTokenizer", "ShardDataModule"]
