"""What language-model objectives (next-token, masked, distilled) share: packed blocks with or without
document boundaries, scored positions, and a cross-entropy that need not hold all float32 logits at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pretraining.errors import ConfigError
from pretraining.models.attention import document_positions
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import PretrainingObjective
from pretraining.ranges import Range, checked_ranges

IGNORE = -100  # a target that counts for nothing
ChunkTokens = Annotated[int, Range(ge=1)] | None  # null: the head and loss over all tokens at once
Head = Callable[[torch.Tensor], torch.Tensor]  # hidden states (..., d_model) to logits: a backbone's `logits`


class Scored(NamedTuple):
    """What a language-model objective scores in a batch of packed blocks."""

    inputs: torch.Tensor  # the token ids the model reads (batch, length)
    documents: torch.Tensor | None  # each input token's document in its block (batch, length); None: one per row
    positions: torch.Tensor | None  # the positions scored (batch, k); None: every one
    targets: torch.Tensor  # their targets, IGNORE where a position counts for nothing


class LanguageModel(PretrainingObjective):
    """Scores token positions of packed blocks (`scored_inputs`) with the backbone's head. `document_masking`:
    attend within the document only; `document_positions`: restart at 0 per document; `loss_chunk_tokens`:
    see `lm_cross_entropy`."""

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Backbone,
        *,
        document_masking: bool = False,
        document_positions: bool = False,
        loss_chunk_tokens: ChunkTokens = None,
        **settings: Any,
    ) -> None:
        """`settings`: what every objective takes (`PretrainingObjective`: optimizer, warmup, ...)."""
        super().__init__(backbone, **settings)
        self.document_masking, self.document_positions = document_masking, document_positions
        self.loss_chunk_tokens = loss_chunk_tokens

    def scored_inputs(self, batch: dict[str, torch.Tensor], validation: bool = False) -> Scored:
        """The inputs, scored positions and targets of a batch (a distillation's, with `hidden_at`)."""
        raise NotImplementedError

    def hidden_at(self, scored: Scored) -> torch.Tensor:
        """The backbone's hidden states of `scored.inputs` at the scored positions."""
        hidden = self.packed_hidden(scored.inputs, scored.documents)
        if scored.positions is None:
            return hidden
        return hidden.gather(1, scored.positions[..., None].expand(-1, -1, hidden.shape[-1]))

    def packed_hidden(self, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The backbone's hidden states of packed `tokens` with each token's document (None: one per row)."""
        if documents is None:
            if self.document_masking or self.document_positions:
                raise ConfigError(
                    "model.document_masking and model.document_positions need each batch's doc_ids, which "
                    "PackedBlocks makes, and this batch has none: give your example format doc_ids or leave both false"
                )
            return self.backbone(tokens)
        return self.backbone(
            tokens,
            documents=documents if self.document_masking else None,
            position_ids=document_positions(documents) if self.document_positions else None,
        )

    def scored_loss(self, batch: dict[str, torch.Tensor], reduction: str, validation: bool = False) -> torch.Tensor:
        """The cross-entropy of the backbone's head at the scored positions of `batch`."""
        scored = self.scored_inputs(batch, validation)
        head = self.backbone.logits
        return lm_cross_entropy(self.hidden_at(scored), head, scored.targets, reduction, self.loss_chunk_tokens)

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.scored_loss(batch, "mean")


def input_documents(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The `doc_ids` of a batch's input tokens, or None (a hand-made batch: one document a row)."""
    documents = batch.get("doc_ids")
    return None if documents is None else documents[:, :-1]


def lm_cross_entropy(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Float32 cross-entropy of `head(hidden)` against `targets`. With `chunk_tokens`, head and loss run that
    many tokens at a time under activation checkpointing, so the float32 logits never exist whole."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if chunk_tokens is None:
        return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction=reduction)
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)
    total = torch.stack(
        [checkpoint(summed_cross_entropy, part, head, labels, use_reentrant=False) for part, labels in chunks]
    ).sum()
    return total if reduction == "sum" else total / (targets != IGNORE).sum()


def summed_cross_entropy(hidden: torch.Tensor, head: Head, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")
