"""Masked-token accuracy on held-out text for masked-LM models, with the objective's own validation masks.

Each {"text": ...} line of the task's file is read as the model reads a training text (the example format's
`encode_text`, cut to the length it trains on), masked as `MaskedLM` masks its validation blocks (its
`eval_mask_rate`, `eval_seed`, `mask_prob`, `random_prob`, the line number as the sample id: the masks are the
same at every evaluation and on every rank) and scored at the selected positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from pretraining.data.formats import ExampleFormat
from pretraining.data.tokenizer import MASK_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.extras.evals.retrieval import read_jsonl
from pretraining.extras.evals.task import gathered, share
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.language_model import IGNORE
from pretraining.objectives.masked_lm import MaskedLM, mask_tokens


@dataclass(frozen=True)
class HeldOutText:
    """One text's token ids and its sample id (its line number), which fixes its masks."""

    sample_id: int
    ids: list[int]


class Counts(NamedTuple):
    """One text's score at its selected positions."""

    nll: float  # summed
    selected: int
    correct: int
    masked: int  # the selected positions whose input is MASK
    masked_correct: int


def masked_batch(model: MaskedLM, texts: list[HeldOutText], length: int) -> tuple[torch.Tensor, ...]:
    """(inputs (batch, length), attend, positions (batch, k), labels (batch, k)) of texts masked at the model's
    validation masks, each at its own length (as a full block would be), PAD-padded to `length`; a shorter
    text's extra positions are labelled IGNORE."""
    rows = [
        mask_tokens(
            torch.tensor([text.ids]),
            torch.tensor([text.sample_id]),
            model.eval_mask_rate,
            model.eval_seed,
            model.backbone.vocab_size,
            model.mask_prob,
            model.random_prob,
        )
        for text in texts
    ]
    inputs, positions, labels = (list(part) for part in zip(*rows, strict=True))
    count = max(row.shape[1] for row in positions)
    attend = torch.stack([torch.arange(length) < len(text.ids) for text in texts])
    return stacked(inputs, length, PAD_ID), attend, stacked(positions, count, 0), stacked(labels, count, IGNORE)


def stacked(rows: list[torch.Tensor], width: int, value: int) -> torch.Tensor:
    """One-row tensors padded on the right with `value` to `width`, stacked."""
    return torch.cat([F.pad(row, (0, width - row.shape[1]), value=value) for row in rows])


def masked_counts(model: MaskedLM, texts: list[HeldOutText], length: int) -> list[Counts]:
    """Each text's `Counts` at the model's validation masks: one forward of the backbone and one of its head
    for the batch (under FSDP every rank runs as many)."""
    inputs, attend, positions, labels = (part.to(model.device) for part in masked_batch(model, texts, length))
    hidden = model.backbone(inputs, attend)
    logits = model.backbone.logits(hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))).float()
    selected = labels != IGNORE
    nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none").sum(1)
    correct = (logits.argmax(-1) == labels) & selected
    masked = (inputs.gather(1, positions) == MASK_ID) & selected
    columns = (nll, selected.sum(1), correct.sum(1), masked.sum(1), (masked & correct).sum(1))
    return [Counts(*row) for row in zip(*(column.tolist() for column in columns), strict=True)]


def accuracy_metrics(counts: list[Counts]) -> dict[str, float]:
    """Accuracy and loss over all selected positions, and the accuracy where the input held MASK (what the
    model infers from context alone; left out when the masks drew none)."""
    nll, selected, correct, masked, masked_correct = (sum(column) for column in zip(*counts, strict=True))
    metrics = {"accuracy": correct / selected, "loss": nll / selected}
    return metrics | ({"accuracy_mask": masked_correct / masked} if masked else {})


class MaskedTokenTask:
    """Masked-token accuracy (`accuracy`, `accuracy_mask`) and loss of a `MaskedLM` on the first `limit`
    texts (all: None) of a {"text": ...} jsonl file."""

    def __init__(
        self, name: str, file: Path, data_format: ExampleFormat[Any], batch_size: int = 16, limit: int | None = None
    ) -> None:
        if batch_size < 1 or (limit is not None and limit < 1):
            raise ConfigError(
                f"eval task {name}: batch_size={batch_size} and limit={limit} must be positive (limit may be null)"
            )
        self.name, self.file, self.data_format = name, Path(file), data_format
        self.batch_size, self.limit = batch_size, limit
        self.encoded: dict[int, list[HeldOutText]] = {}  # the texts by the length they are cut to

    @cached_property
    def lines(self) -> list[tuple[int, str]]:
        """(line number, text) of the file's first `limit` texts, read once."""
        lines = [(number, record["text"]) for number, record in read_jsonl(self.file, ["text"])][: self.limit]
        if not lines:
            raise ConfigError(f'{self.file} holds no text: give it {{"text": ...}} lines of held-out text')
        return lines

    def texts(self, length: int) -> list[HeldOutText]:
        """The texts as token ids, each cut to `length` (tokenised once); one without any token is refused
        naming its line."""
        if length in self.encoded:
            return self.encoded[length]
        texts = [HeldOutText(number, self.data_format.encode_text(text, length)) for number, text in self.lines]
        for number, text in zip(self.lines, texts, strict=True):
            if not text.ids:
                raise ConfigError(f"{self.file}:{number[0]}: the text has no token: remove the line")
        self.encoded[length] = texts
        return texts

    def check(self, model: PretrainingObjective) -> None:
        """Refuse a model that is not a `MaskedLM`, then read and tokenise the file (refusing a bad one)."""
        if not isinstance(model, MaskedLM):
            raise ConfigError(
                f"eval task {self.name} is a masked-token task, which scores MaskedLM models, and this run trains "
                f"{type(model).__name__}: remove it from the evaluation's tasks"
            )
        self.texts(self.trained_length(model))

    def trained_length(self, model: MaskedLM) -> int:
        """The longest text the model reads in training."""
        return min(self.data_format.trained_length, int(model.backbone.max_seq_len))

    def evaluate(self, model: PretrainingObjective) -> dict[str, float]:
        return accuracy_metrics(self.counts(model))

    @torch.no_grad()
    def counts(self, model: PretrainingObjective) -> list[Counts]:
        """Each text's `Counts`, the same on every rank."""
        assert isinstance(model, MaskedLM)
        length = self.trained_length(model)
        texts = self.texts(length)
        counts = [row for batch in share(texts, self.batch_size) for row in masked_counts(model, batch, length)]
        return gathered(counts, len(texts))
