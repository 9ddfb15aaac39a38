"""Example formats, the one place that knows a kind of example: what a format is, and packed blocks.

The DataModule builds the format `data.format` names with the run's tokenizer; an objective declares the one
it trains on (`PretrainingObjective.example_format`). A new kind of example is a new format (a module of its
own), an objective that reads it, and their configs. `PackedBlocks` serves next-token and masked-LM;
`TokenizedPairs` (`pretraining.data.pair_format`, not loaded by a language-model run) contrastive.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import numpy as np
import torch

from pretraining.data.manifest import TEXT_FIELDS
from pretraining.data.tokenizer import PAD_ID, Tokenizer
from pretraining.ranges import Positive, checked_ranges

Example = TypeVar("Example")
Tensors = dict[str, torch.Tensor]


class ExampleFormat(Protocol[Example]):
    """How a shard's decoded samples become examples, and what an example is."""

    fields: tuple[str, ...]  # the sample fields it reads (`pretraining.data.reader.field_text`): field_keys' first
    field_keys: dict[str, str]  # the keys of data.format that name those fields, and their values
    kind: ClassVar[str]  # its examples in a word, for messages: "blocks", "pairs"
    lengths: dict[str, int]  # the lengths (keys of data.format) that decide how samples become examples
    tokenizer: Tokenizer

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Example]: ...

    def tensors(self, example: Example) -> Tensors: ...

    @property
    def example_tokens(self) -> int:
        """The tokens of one example (what `data.global_batch_tokens` counts)."""
        ...

    @property
    def trained_length(self) -> int:
        """The longest text, in tokens, that the model reads in training (a probe's text is cut to it)."""
        ...

    def encode_text(self, text: str, length: int) -> list[int]:
        """One text (a probe's) as the model reads a training text, cut to `length` tokens."""
        ...


# --- packed blocks of text ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """`block_size + 1` tokens (the extra one, shared with the next block, keeps next-token targets inside)
    and the index of each token's document within the block."""

    tokens: list[int]
    doc_ids: list[int]


def encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """A document's tokens followed by the tokenizer's EOS (after its BOS, where it has one to start with)."""
    start = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [*start, *tokenizer.encode(text), tokenizer.eos_id]


def pack_blocks(documents: Iterable[list[int]], block_size: int) -> Iterator[Block]:
    """Documents (each ending in EOS) packed into overlapping blocks; the tokens left at the end are dropped."""
    tokens: list[int] = []
    doc_ids: list[int] = []
    for number, document in enumerate(documents):
        tokens.extend(document)
        doc_ids.extend([number] * len(document))
        start = 0
        while len(tokens) - start > block_size:
            end, first_doc = start + block_size + 1, doc_ids[start]
            yield Block(tokens[start:end], [d - first_doc for d in doc_ids[start:end]])
            start += block_size
        # Once per document, not per block: a long document packs in linear time.
        del tokens[:start], doc_ids[:start]


def shares(lengths: Sequence[int], budget: int) -> list[int]:
    """`budget` shared out over documents of `lengths` as evenly as they allow (a short one gives all it has)."""
    given = [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for taken, index in enumerate(order):
        given[index] = min(lengths[index], budget // (len(order) - taken))
        budget -= given[index]
    return given


def middle_lines(text: str, length: int) -> str:
    """About `length` UTF-8 bytes of whole lines from the middle of `text` (of the middle itself where whole
    lines would give less than half)."""
    data = text.encode()
    if len(data) <= length:
        return text
    middle = (len(data) - length) // 2
    start = data.rfind(b"\n", 0, middle) + 1  # the start of the line there
    end = data.rfind(b"\n", start, start + length) + 1
    if end - start < length // 2:
        start, end = middle, middle + length
    return data[start:end].decode(errors="ignore")  # a character cut at either end is left out


def block_tensors(block: Block, token_bytes: np.ndarray) -> Tensors:
    """The tensors of one block, as the objectives receive them (after batching)."""
    tokens = np.asarray(block.tokens, dtype=np.int64)
    return {
        "tokens": torch.from_numpy(tokens),
        "doc_ids": torch.tensor(block.doc_ids, dtype=torch.int64),
        # UTF-8 bytes behind the next-token targets: the denominator of bits per byte.
        "target_bytes": torch.tensor(int(token_bytes[tokens[1:]].sum())),
    }


class PackedBlocks:
    """Documents tokenised, separated by EOS and packed into `block_size + 1`-token blocks."""

    kind: ClassVar[str] = "blocks"

    @checked_ranges("data.format")
    def __init__(self, tokenizer: Tokenizer, block_size: Positive, text_field: str = TEXT_FIELDS[0]) -> None:
        self.tokenizer, self.block_size = tokenizer, block_size
        self.lengths = {"block_size": block_size}
        self.field_keys = {"text_field": text_field}
        self.fields = (text_field,)

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Block]:
        return pack_blocks((encode_document(self.tokenizer, text) for (text,) in samples), self.block_size)

    def validation_texts(self, documents: Sequence[tuple[str, ...]], size: int) -> list[tuple[str, ...]]:
        """`size * block_size` UTF-8 bytes shared out over `documents` as a window from the middle of each: the
        same text whatever the tokenizer. Optional in a format: without it, validation reads documents whole."""
        texts = [text for (text,) in documents]
        budgets = shares([len(text.encode()) for text in texts], size * self.block_size)
        return [(middle_lines(text, budget),) for text, budget in zip(texts, budgets, strict=True)]

    def tensors(self, example: Block) -> Tensors:
        return block_tensors(example, self.tokenizer.token_bytes)

    @property
    def example_tokens(self) -> int:
        return self.block_size

    @property
    def trained_length(self) -> int:
        return self.block_size

    def encode_text(self, text: str, length: int) -> list[int]:
        return self.tokenizer.encode(text)[:length]


def padded(ids: list[int], length: int) -> torch.Tensor:
    return torch.tensor(ids + [PAD_ID] * (length - len(ids)), dtype=torch.int64)
