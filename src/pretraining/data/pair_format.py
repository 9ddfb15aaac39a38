"""The example format of contrastive training, in a module of its own so that a language-model run does not
load it: `TokenizedPairs` makes (query, passage) pairs, each side CLS-prefixed, cut and PAD-padded to its own
length (`pretraining.data.formats` says what a format is)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, ClassVar

import torch

from pretraining.data.formats import Tensors, padded
from pretraining.data.manifest import PAIR_FIELDS, negative_fields
from pretraining.data.tokenizer import CLS_ID, Tokenizer
from pretraining.errors import ConfigError
from pretraining.ranges import Range, checked_ranges

SideLength = Annotated[int, Range(ge=2)]  # two tokens at least: CLS and one of the text


@dataclass(frozen=True)
class Pair:
    """The token ids of a query, its passage and its hard negatives (passages too), each starting with CLS and
    truncated to its side's length."""

    query: list[int]
    passage: list[int]
    negatives: tuple[list[int], ...] = ()


class TokenizedPairs:
    """(query, passage) text pairs, each side tokenised, CLS-prefixed, truncated and padded
    to its own fixed length (PAD marks the padding, so the towers can mask it). With `hard_negatives`, each pair's
    first that many mined negatives too (`pretrain-data negatives` writes them), passages of `passage_len`."""

    kind: ClassVar[str] = "pairs"

    @checked_ranges("data.format")
    def __init__(
        self,
        tokenizer: Tokenizer,
        query_len: SideLength,
        passage_len: SideLength,
        query_field: str = PAIR_FIELDS[0],
        passage_field: str = PAIR_FIELDS[1],
        hard_negatives: Annotated[int, Range(ge=0)] = 0,
    ) -> None:
        if tokenizer.cls_id != CLS_ID:
            raise ConfigError(
                f"contrastive pairs start each side with the template's <cls> (id {CLS_ID}), and "
                f"{type(tokenizer).__name__} has none there: use tokenizer=bytes or a BPE trained by "
                "`pretrain-data tokenizer`"
            )
        self.tokenizer, self.query_len, self.passage_len = tokenizer, query_len, passage_len
        self.lengths = {"query_len": query_len, "passage_len": passage_len}
        self.hard_negatives = hard_negatives
        self.field_keys = {"query_field": query_field, "passage_field": passage_field}
        self.fields = (query_field, passage_field, *negative_fields(hard_negatives))

    def examples(self, samples: Iterable[tuple[str, ...]]) -> Iterator[Pair]:
        for query, *passages in samples:
            encoded = [self.encode_text(passage, self.passage_len) for passage in passages]
            yield Pair(self.encode_text(query, self.query_len), encoded[0], tuple(encoded[1:]))

    def tensors(self, example: Pair) -> Tensors:
        made = {"query": padded(example.query, self.query_len), "passage": padded(example.passage, self.passage_len)}
        if example.negatives:
            made["negatives"] = torch.stack([padded(negative, self.passage_len) for negative in example.negatives])
        return made

    @property
    def example_tokens(self) -> int:
        return self.query_len + (1 + self.hard_negatives) * self.passage_len

    @property
    def trained_length(self) -> int:
        """A passage's: probe texts are code, as passages are."""
        return self.passage_len

    def encode_text(self, text: str, length: int) -> list[int]:
        """One side's ids: CLS, then the text's tokens, `length` in all at most."""
        return [CLS_ID, *self.tokenizer.encode(text)[: length - 1]]
