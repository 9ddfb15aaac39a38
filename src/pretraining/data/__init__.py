"""Corpus readers, shard builder and manifest, tokenizers, example formats, the resumable shard stream
and the DataModule."""

from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import ExampleFormat, PackedBlocks, TokenizedPairs
from pretraining.data.tokenizer import BPETokenizer, ByteTokenizer

__all__ = ["BPETokenizer", "ByteTokenizer", "ExampleFormat", "PackedBlocks", "ShardDataModule", "TokenizedPairs"]
