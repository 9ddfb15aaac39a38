"""What the language-model objectives (next-token, masked-LM, and students distilled from them) share:
packed blocks read with or without document boundaries, the positions they score, and a cross-entropy
that need never hold all float32 logits at once."""

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
    """An objective over packed blocks that scores token positions (`scored_inputs`) with the backbone's head.

    `document_masking`: a position attends only within its own document; `document_positions`: positions
    restart at 0 at each document. `loss_chunk_tokens`: the head and loss run over that many tokens at a
    time (see `lm_cross_entropy`)."""

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
        """The inputs, scored positions and targets of a batch (with `hidden_at`, also what a distillation
        needs of its student and teacher)."""
        raise NotImplementedError

    def hidden_at(self, scored: Scored) -> torch.Tensor:
        """The backbone's hidden states of `scored.inputs` at the scored positions."""
        hidden = self.packed_hidden(scored.inputs, scored.documents)
        if scored.positions is None:
            return hidden
        return hidden.gather(1, scored.positions[..., None].expand(-1, -1, hidden.shape[-1]))

    def packed_hidden(self, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The backbone's hidden states of packed `tokens`, whose `documents` are each token's document
        (None: each row is one)."""
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
    """The documents of a batch's input tokens (all but each block's last), if the batch has them: packed
    blocks from the data do (`doc_ids`); a batch made by hand may not, and is then one document a row."""
    documents = batch.get("doc_ids")
    return None if documents is None else documents[:, :-1]


def lm_cross_entropy(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits `head(hidden)` against `targets` (IGNORE counts for nothing), in float32.

    With `chunk_tokens`, the head and the loss run over that many tokens at a time under activation
    checkpointing: the float32 logits (tokens x vocabulary) never exist whole, forward or backward;
    each chunk's are recomputed in backward. The result equals the plain path's up to rounding."""
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
