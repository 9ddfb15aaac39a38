"""One head: a backbone that overrides `logits` (a soft-capped or scaled head) is scored with it by every
training loss, validation and generation, chunked or not."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.language_model import IGNORE, LanguageModel
from pretraining.objectives.masked_lm import MaskedLM

VOCAB = 100
CAP = 0.05  # far below the logits of a fresh model, so that the cap changes every loss


class SoftCapped(Transformer):
    """Gemma 2's head: the logits soft-capped at `CAP`."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return CAP * torch.tanh(super().logits(hidden) / CAP)


def soft_capped(objective: type[LanguageModel], **settings: object) -> LanguageModel:
    torch.manual_seed(0)
    backbone = SoftCapped(
        vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2, causal=objective is CausalLM
    )
    return objective(backbone, optimizer=partial(torch.optim.AdamW), **settings)


def blocks() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {
        "tokens": torch.randint(8, VOCAB, (3, 33)),
        "sample_id": torch.arange(3),
        "target_bytes": torch.ones(3, 32, dtype=torch.long),
    }


def summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("objective", [CausalLM, MaskedLM])
def test_training_and_validation_losses_score_with_the_backbones_head(objective: type, chunk: int | None) -> None:
    model = soft_capped(objective, loss_chunk_tokens=chunk)
    batch = blocks()
    with torch.no_grad():
        losses = {"train": model.training_loss(batch), "val": model.validation_update(batch)["nll"]}
    for validation, loss in ((False, losses["train"]), (True, losses["val"])):
        scored = model.scored_inputs(batch, validation)
        hidden = model.hidden_at(scored).detach()
        expected = summed_nll(model.backbone.logits(hidden), scored.targets)
        if not validation:
            expected = expected / (scored.targets != IGNORE).sum()
        assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
        plain = summed_nll(F.linear(hidden, model.backbone.head_weight), scored.targets)  # the uncapped head
        assert abs(plain.item() - summed_nll(model.backbone.logits(hidden), scored.targets).item()) > 1e-2
    # The FLOPs count is the projection's, whatever the head does after it.
    assert model.backbone.head_flops_per_token() == 6 * model.backbone.head_weight.numel()


def test_generation_samples_from_the_backbones_head(monkeypatch: pytest.MonkeyPatch) -> None:
    model = soft_capped(CausalLM).eval()
    sampled_from, multinomial = [], torch.multinomial

    def spy(probabilities: torch.Tensor, count: int) -> torch.Tensor:
        sampled_from.append(probabilities)
        return multinomial(probabilities, count)

    monkeypatch.setattr(torch, "multinomial", spy)
    prompt = torch.tensor([[5, 6, 7]])
    tokens = model.generate(prompt, max_new_tokens=3)
    assert len(sampled_from) == 3
    with torch.no_grad():
        for step, probabilities in enumerate(sampled_from):
            logits = model.backbone.logits(model.backbone(tokens[:, : prompt.shape[1] + step]))
            torch.testing.assert_close(probabilities, logits[:, -1, :VOCAB].float().softmax(-1))
