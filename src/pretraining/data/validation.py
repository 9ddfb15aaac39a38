"""The validation set: a fixed sample spread over the whole validation split, the same every time and on
any number of devices (each source's: `ShardDataModule.validation_sets`), dealt to ranks in equal shares
(`rank_share`). Without Lightning: `pretrain-data build` warns of a split too small (`DEVICE_MULTIPLE`)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pretraining.data.formats import ExampleFormat, Tensors
from pretraining.data.reader import SampleReader
from pretraining.errors import ShardError

# A multiple of this many examples is kept: left-overs would be dropped on some numbers of devices, not others.
DEVICE_MULTIPLE = 8


@dataclass(frozen=True)
class ValidationSet:
    """The validation examples (each with its position as `sample_id`), the documents they were made from
    and those of the split, and the UTF-8 bytes of the texts they read."""

    examples: list[Tensors]
    documents: int
    split_documents: int
    text_bytes: int


def shared_alike(count: int) -> int:
    """How many of `count` examples to keep: a multiple of `DEVICE_MULTIPLE` (or of a smaller power of two)."""
    if count == 0:
        return 0
    multiple = min(DEVICE_MULTIPLE, 1 << (count.bit_length() - 1))
    return count - count % multiple


def spread(count: int, total: int) -> set[int]:
    """`count` of the indices 0 .. total - 1, evenly spaced (all of them when count >= total)."""
    return {index * total // count for index in range(count)} if count < total else set(range(total))


def validation_examples(
    urls: Sequence[str], format: ExampleFormat, size: int, split_documents: int, policy: str = "skip"
) -> ValidationSet:
    """Up to `size` of the split's `split_documents` documents, evenly spaced, made into examples (through the
    format's optional `validation_texts`)."""
    chosen = spread(min(size, split_documents), split_documents)
    samples = itertools.islice(SampleReader(format.fields, policy).all_texts(urls), max(chosen, default=-1) + 1)
    documents = [sample for index, sample in enumerate(samples) if index in chosen]
    if len(documents) < len(chosen):
        warnings.warn(
            f"validation reads {len(documents)} of the {len(chosen)} documents it chose: the validation shards hold "
            f"fewer usable samples than their manifest counts (see the bad-data warnings)",
            stacklevel=2,
        )
    choose = getattr(format, "validation_texts", None)  # optional (not in the Protocol): a format's own budget
    texts = choose(documents, size) if choose else documents
    made = list(itertools.islice(format.examples(texts), size))
    made = [made[index] for index in sorted(spread(shared_alike(len(made)), len(made)))]  # left out: spread too
    examples = [format.tensors(example) | {"sample_id": torch.tensor(index)} for index, example in enumerate(made)]
    text_bytes = sum(len(field.encode()) for text in texts for field in text)
    return ValidationSet(examples, len(documents), split_documents, text_bytes)


def rank_share(examples: list[Tensors], rank: int, world_size: int, kind: str) -> list[Tensors]:
    """The validation `examples` (`kind`, for the message) of one rank: equal counts on every rank, as unequal
    ones deadlock the metric reduction."""
    per_rank = len(examples) // world_size
    if per_rank == 0:
        raise ShardError(
            f"the validation shards give {len(examples)} {kind}, fewer than {world_size} ranks; "
            f"build the shards with a larger --validation-fraction"
        )
    return examples[rank::world_size][:per_rank]
