"""Masked-language modelling over packed blocks, with reproducible fixed-count masking.

Masks are drawn from a counter-based hash of (seed, sample id, position), not
from a stateful generator: the same block always gets the same mask for the
same seed, whatever the rank, worker count, step or restart, and different
blocks (including the same text in another epoch, which has another sample
id) get different masks. So a resumed run masks exactly as an uninterrupted
one, ranks never mask alike, and the validation masks are fixed.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F

from pretraining.data.tokenizer import MASK_ID, SPECIAL_TOKENS, Tokenizer
from pretraining.errors import ConfigError
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import sums
from pretraining.objectives.language_model import IGNORE, LanguageModel, Scored, input_documents
from pretraining.ranges import Range, checked_ranges

MaskRate = Annotated[float, Range(gt=0, lt=1)]
Probability = Annotated[float, Range(ge=0, le=1)]
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche, on int64 tensors holding values below 2**32
    (the multiplier is small enough that no product overflows int64)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def hashed_uniform(seed: int, stream: int, sample_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1), a pure function of (seed, stream, sample id, position).

    `sample_ids` (batch,) are non-negative int64; `positions` (batch, n) index within each sample.
    """
    key = int(_mix32(torch.tensor(((seed & _M32) * 31 + stream) & _M32)))
    row = _mix32(_mix32(key ^ (sample_ids & _M32)) ^ ((sample_ids >> 32) & _M32))
    bits = _mix32(row[:, None] ^ positions)
    return (bits >> 8).to(torch.float32) * 2.0**-24  # 24 bits: exact in float32, never 1.0


def masked_count(rate: float, length: int) -> int:
    """How many positions of a `length`-token block are selected at `rate`."""
    return max(1, round(rate * length))


def mask_tokens(
    tokens: torch.Tensor,
    sample_ids: torch.Tensor,
    rate: float,
    seed: int,
    vocab_size: int,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BERT masking with a fixed number of positions per block.

    Selects `round(rate * length)` positions per row among the non-special tokens (never
    EOS separators or other special ids); of those, `mask_prob` become MASK, `random_prob`
    a random non-special id and the rest stay unchanged. Returns (inputs, positions (batch, k),
    labels (batch, k)); a row with fewer selectable tokens than k labels the extra positions
    IGNORE, so shapes stay static.
    """
    batch, length = tokens.shape
    count = masked_count(rate, length)
    special = tokens < len(SPECIAL_TOKENS)
    every_position = torch.arange(length, device=tokens.device).expand(batch, length)
    scores = hashed_uniform(seed, 0, sample_ids, every_position).masked_fill(special, -1.0)
    positions = scores.topk(count, dim=1).indices
    original = tokens.gather(1, positions)
    selectable = ~special.gather(1, positions)
    action = hashed_uniform(seed, 1, sample_ids, positions)
    random_ids = (
        len(SPECIAL_TOKENS)
        + (hashed_uniform(seed, 2, sample_ids, positions) * (vocab_size - len(SPECIAL_TOKENS))).long()
    )
    kept_or_random = torch.where(action < mask_prob + random_prob, random_ids, original)
    replaced = torch.where(action < mask_prob, MASK_ID, kept_or_random)
    inputs = tokens.scatter(1, positions, torch.where(selectable, replaced, original))
    return inputs, positions, original.masked_fill(~selectable, IGNORE)


SELECTED_KINDS = ("mask", "random", "kept")


def selected_kinds(inputs_at: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Which selected positions the model saw as `<mask>`, as another token, or unchanged (a random
    replacement that drew the original token counts as kept: the model sees no difference)."""
    mask = inputs_at == MASK_ID
    kept = inputs_at == labels
    return {"mask": mask, "random": ~mask & ~kept, "kept": kept}


class MaskedLM(LanguageModel):
    """BERT-style masked-language model over packed blocks with a bidirectional backbone.

    Trains at `mask_rate` (0.3, as MosaicBERT found best) and validates at the standard
    `eval_mask_rate` (0.15) with masks fixed by `eval_seed`, so validation numbers compare
    across runs. The head and the loss see only the selected positions.
    """

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Backbone,
        *,
        mask_rate: MaskRate = 0.3,
        eval_mask_rate: MaskRate = 0.15,
        mask_prob: Probability = 0.8,
        random_prob: Probability = 0.1,
        seed: int = 0,
        eval_seed: int = 0,
        **settings: Any,
    ) -> None:
        """`settings`: what every language model takes (`LanguageModel`: document masking, loss chunks, the
        optimizer, warmup, ...)."""
        if backbone.causal:
            raise ConfigError("MaskedLM needs a bidirectional backbone: set model.backbone.causal=false")
        if mask_prob + random_prob > 1:
            raise ConfigError(
                f"model.mask_prob={mask_prob} and model.random_prob={random_prob} must have a sum of at most 1 "
                f"(the rest of the selected tokens stay unchanged)"
            )
        counts = [f"{name}_{kind}" for kind in SELECTED_KINDS for name in ("masked", "correct")]
        super().__init__(backbone, validation_state=sums("nll", "masked", "correct", *counts), **settings)
        self.mask_rate, self.eval_mask_rate = mask_rate, eval_mask_rate
        self.mask_prob, self.random_prob = mask_prob, random_prob
        self.seed, self.eval_seed = seed, eval_seed

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        if getattr(tokenizer, "mask_id", None) != MASK_ID:
            raise ConfigError(
                f"MaskedLM needs a tokenizer with the mask token at id {MASK_ID}, and {type(tokenizer).__name__} "
                f"has none: use tokenizer=bytes or a BPE trained by `pretrain-data tokenizer` (both reserve <mask>)"
            )

    def masked_inputs(
        self, batch: dict[str, torch.Tensor], rate: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, positions, labels) of a batch masked at `rate`; the block's last token is the next block's first."""
        return mask_tokens(
            batch["tokens"][:, :-1],
            batch["sample_id"],
            rate,
            seed,
            self.backbone.vocab_size,
            self.mask_prob,
            self.random_prob,
        )

    def scored_inputs(self, batch: dict[str, torch.Tensor], validation: bool = False) -> Scored:
        """The masked positions are scored: at `mask_rate` in training, at the fixed validation masks in validation."""
        rate, seed = (self.eval_mask_rate, self.eval_seed) if validation else (self.mask_rate, self.seed)
        inputs, positions, labels = self.masked_inputs(batch, rate, seed)
        return Scored(inputs, input_documents(batch), positions, labels)

    def head_positions(self, length: int) -> int:
        """Only the masked positions reach the head: the others' hidden states are never gathered."""
        return masked_count(self.mask_rate, length)

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scored = self.scored_inputs(batch, validation=True)
        logits = self.backbone.logits(self.hidden_at(scored))
        labels = scored.targets
        counted = labels != IGNORE
        correct = (logits.argmax(-1) == labels) & counted
        nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        update = {"nll": nll, "masked": counted.sum(), "correct": correct.sum()}
        assert scored.positions is not None
        for kind, selected in selected_kinds(scored.inputs.gather(1, scored.positions), labels).items():
            update |= {f"masked_{kind}": (selected & counted).sum(), f"correct_{kind}": (selected & correct).sum()}
        return update

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Accuracy over all selected positions, and at each kind apart: only `mask` shows what the model
        infers from context (`kept` can be copied from the input). A kind the masks never drew is left out."""
        accuracies = {
            f"accuracy_{kind}": totals[f"correct_{kind}"] / totals[f"masked_{kind}"]
            for kind in SELECTED_KINDS
            if totals[f"masked_{kind}"] > 0
        }
        return {"loss": totals["nll"] / totals["masked"], "accuracy": totals["correct"] / totals["masked"]} | accuracies
