"""Masked-LM: the masking rule, its reproducibility, the gathered-rows loss and learning."""

from __future__ import annotations

import itertools
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import fit_batch
from pretraining.data.batches import BatchStream, batch_plan
from pretraining.data.formats import PackedBlocks
from pretraining.data.manifest import Manifest
from pretraining.data.stream import ShardStream
from pretraining.data.tokenizer import EOS_ID, MASK_ID, SPECIAL_TOKENS, ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import build_objective
from pretraining.objectives.language_model import Scored
from pretraining.objectives.masked_lm import IGNORE, MaskedLM, hashed_uniform, mask_tokens

VOCAB = 260
SPECIAL = len(SPECIAL_TOKENS)


def random_blocks(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token blocks with EOS separators and a few other special ids sprinkled in."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SPECIAL, VOCAB, (rows, length), generator=generator)
    specials = torch.rand(rows, length, generator=generator) < 0.08
    return torch.where(specials, torch.randint(0, SPECIAL, (rows, length), generator=generator), tokens)


def tiny_mlm(**options: object) -> MaskedLM:
    backbone = Transformer(vocab_size=VOCAB, max_seq_len=64, d_model=32, n_layer=2, n_head=2, causal=False)
    return MaskedLM(backbone, optimizer=partial(torch.optim.AdamW, lr=3e-3), **options)


def test_hashed_uniform_is_uniform_and_a_pure_function() -> None:
    ids = torch.arange(4000, dtype=torch.int64) * 7919 + (1 << 40)
    positions = torch.arange(128).expand(len(ids), 128)
    values = hashed_uniform(3, 0, ids, positions)
    assert values.min() >= 0 and values.max() < 1
    histogram = np.histogram(values.numpy(), bins=20, range=(0, 1))[0] / values.numel()
    assert np.abs(histogram - 0.05).max() < 0.002
    assert torch.equal(values, hashed_uniform(3, 0, ids, positions))
    # Seed, stream, sample id and position each change the draw.
    for other in (hashed_uniform(4, 0, ids, positions), hashed_uniform(3, 1, ids, positions)):
        assert (other != values).float().mean() > 0.99
    assert (hashed_uniform(3, 0, ids + 1, positions) != values).float().mean() > 0.99
    neighbours = values[:, 1:] - values[:, :-1]
    assert abs(float(np.corrcoef(values[:, 1:].flatten(), values[:, :-1].flatten())[0, 1])) < 0.01
    assert neighbours.abs().mean() > 0.3  # about 1/3 for independent uniforms


@pytest.mark.parametrize("rate", [0.15, 0.3])
def test_masking_statistics_match_the_rule(rate: float) -> None:
    tokens = random_blocks(3000, 128)
    ids = torch.arange(len(tokens))
    inputs, positions, labels = mask_tokens(tokens, ids, rate, seed=11, vocab_size=VOCAB)
    count = round(rate * 128)
    assert positions.shape == labels.shape == (3000, count)
    # Exactly `count` distinct positions per row, never a special token (every row has enough others).
    assert all(len(set(row)) == count for row in positions.tolist())
    assert (labels != IGNORE).all()
    assert torch.equal(labels, tokens.gather(1, positions))
    assert (tokens.gather(1, positions) >= SPECIAL).all()
    # Nothing outside the selected positions changes; special tokens never change.
    changed = inputs != tokens
    selected = torch.zeros_like(tokens, dtype=torch.bool).scatter(1, positions, True)
    assert not (changed & ~selected).any()
    assert torch.equal(inputs[tokens < SPECIAL], tokens[tokens < SPECIAL])
    # 80 / 10 / 10 among the selected (a random token equals the original 1/256 of the time).
    chosen = inputs.gather(1, positions)
    masked = (chosen == MASK_ID).float().mean()
    randomised = (chosen != MASK_ID) & (chosen != labels)
    unchanged = (chosen == labels).float().mean()
    assert masked == pytest.approx(0.8, abs=0.01)
    assert randomised.float().mean() == pytest.approx(0.1 * (1 - 1 / (VOCAB - SPECIAL)), abs=0.006)
    assert unchanged == pytest.approx(0.1 + 0.1 / (VOCAB - SPECIAL), abs=0.006)
    # Random replacements are ordinary tokens, spread over the whole non-special vocabulary.
    replacements = chosen[randomised]
    assert replacements.min() >= SPECIAL and replacements.max() < VOCAB
    assert len(replacements.unique()) > 0.9 * (VOCAB - SPECIAL)
    # Every position is selected about equally often among non-special tokens.
    rate_by_position = selected.sum(0).float() / (tokens >= SPECIAL).sum(0)
    assert rate_by_position.min() > 0.8 * rate / (1 - 0.08) and rate_by_position.max() < 1.2 * rate / (1 - 0.08)


def test_masking_configurable_split() -> None:
    tokens = random_blocks(500, 64)
    inputs, positions, _ = mask_tokens(tokens, torch.arange(500), 0.3, 0, VOCAB, mask_prob=1.0, random_prob=0.0)
    assert (inputs.gather(1, positions) == MASK_ID).all()
    inputs, positions, _ = mask_tokens(tokens, torch.arange(500), 0.3, 0, VOCAB, mask_prob=0.0, random_prob=0.0)
    assert torch.equal(inputs, tokens)


def test_rows_with_few_ordinary_tokens_ignore_the_rest() -> None:
    tokens = torch.full((2, 20), EOS_ID)
    tokens[0, [3, 9]] = 100  # two ordinary tokens, but 6 positions are drawn
    tokens[1] = torch.arange(20) + SPECIAL
    inputs, positions, labels = mask_tokens(tokens, torch.tensor([5, 6]), 0.3, 0, VOCAB)
    assert positions.shape == (2, 6)
    assert sorted(positions[0][labels[0] != IGNORE].tolist()) == [3, 9]
    assert (labels[0] == IGNORE).sum() == 4
    assert torch.equal(inputs[0][tokens[0] == EOS_ID], tokens[0][tokens[0] == EOS_ID])
    assert (labels[1] != IGNORE).all()


def test_masks_repeat_for_the_same_sample_and_differ_otherwise() -> None:
    tokens = random_blocks(64, 128)
    ids = torch.arange(64) + 1000
    first = mask_tokens(tokens, ids, 0.3, 5, VOCAB)
    again = mask_tokens(tokens.clone(), ids.clone(), 0.3, 5, VOCAB)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    for other in (mask_tokens(tokens, ids + 64, 0.3, 5, VOCAB), mask_tokens(tokens, ids, 0.3, 6, VOCAB)):
        overlap = [len(set(a) & set(b)) for a, b in zip(first[1].tolist(), other[1].tolist(), strict=True)]
        assert max(overlap) < 38  # 38 of 128 drawn twice independently overlap by about 11


def test_ranks_and_steps_never_mask_alike(shard_dir: Path) -> None:
    """The stream names every block by (epoch, shard, position): two ranks, and two steps of one
    rank, see different sample ids, hence different masks; a restarted stream repeats them."""
    urls = Manifest.load(shard_dir).urls("train")
    tokenizer = ByteTokenizer()

    def batches(rank: int, count: int) -> list[dict[str, torch.Tensor]]:
        stream = BatchStream([ShardStream(urls, PackedBlocks(tokenizer, 63), seed=3)], batch_plan(16, 8, 2, 2), rank)
        return list(itertools.islice(stream, count))

    rank0, rank1 = batches(0, 6), batches(1, 6)
    ids = [int(i) for batch in rank0 + rank1 for i in batch["sample_id"]]
    assert len(set(ids)) == len(ids)
    masks = [mask_tokens(b["tokens"][:, :-1], b["sample_id"], 0.3, 3, VOCAB)[1] for b in rank0 + rank1]
    assert len({tuple(m.flatten().tolist()) for m in masks}) == len(masks)
    for original, repeated in zip(rank0, batches(0, 6), strict=True):
        assert torch.equal(original["sample_id"], repeated["sample_id"])


def masked_logits(model: MaskedLM, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The model's logits at `positions` of `inputs`, one document a row."""
    return model.backbone.logits(model.hidden_at(Scored(inputs, None, positions, torch.empty(0))))


def test_gathered_loss_equals_full_sequence_cross_entropy() -> None:
    torch.manual_seed(0)
    model = tiny_mlm()
    batch = {"tokens": random_blocks(4, 65), "sample_id": torch.arange(4)}
    tokens = batch["tokens"][:, :-1]
    inputs, positions, labels = mask_tokens(tokens, batch["sample_id"], 0.3, 0, VOCAB)
    full_logits = model.backbone.logits(model.backbone(inputs))
    full_labels = torch.full_like(tokens, IGNORE).scatter(1, positions, labels)
    expected = F.cross_entropy(full_logits.flatten(0, 1), full_labels.flatten(), ignore_index=IGNORE)
    assert model.training_loss(batch).item() == pytest.approx(expected.item(), rel=1e-6)
    at_positions = full_logits.gather(1, positions[..., None].expand(-1, -1, full_logits.shape[-1]))
    assert torch.allclose(masked_logits(model, inputs, positions), at_positions, atol=1e-5)


def test_validation_sums_use_the_eval_rate_and_seed() -> None:
    model = tiny_mlm(mask_rate=0.3, eval_mask_rate=0.15, eval_seed=9)
    batch = {"tokens": random_blocks(3, 65), "sample_id": torch.arange(3)}
    sums = model.validation_update(batch)
    assert int(sums["masked"]) == 3 * round(0.15 * 64)
    inputs, positions, labels = model.masked_inputs(batch, 0.15, 9)
    logits = masked_logits(model, inputs, positions)
    assert int(sums["correct"]) == int((logits.argmax(-1) == labels).sum())
    assert float(sums["nll"]) == pytest.approx(
        float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
    )
    # Another seed masks other positions, so the summed loss differs.
    other_inputs, other_positions, other_labels = model.masked_inputs(batch, 0.15, 0)
    other_logits = masked_logits(model, other_inputs, other_positions)
    assert not torch.equal(other_labels, labels)
    assert float(sums["nll"]) != pytest.approx(
        float(F.cross_entropy(other_logits.flatten(0, 1), other_labels.flatten(), reduction="sum"))
    )
    metrics = model.validation_metrics({k: v.double() for k, v in sums.items()})
    assert float(metrics["accuracy"]) == pytest.approx(int(sums["correct"]) / int(sums["masked"]))

    # Apart at each kind of selected position: what the model saw there decides the kind.
    seen = inputs.gather(1, positions)
    kinds = {"mask": seen == MASK_ID, "kept": seen == labels, "random": (seen != MASK_ID) & (seen != labels)}
    right = logits.argmax(-1) == labels
    for kind, where in kinds.items():
        assert int(sums[f"masked_{kind}"]) == int(where.sum()) > 0, kind
        assert float(metrics[f"accuracy_{kind}"]) == pytest.approx(int((right & where).sum()) / int(where.sum()))
    assert sum(int(sums[f"masked_{kind}"]) for kind in kinds) == int(sums["masked"])


def test_a_kind_of_position_the_masks_never_draw_is_not_reported() -> None:
    model = tiny_mlm(mask_prob=1.0, random_prob=0.0)  # every selected position is <mask>
    sums = model.validation_update({"tokens": random_blocks(3, 65), "sample_id": torch.arange(3)})
    metrics = model.validation_metrics({k: v.double() for k, v in sums.items()})
    assert set(metrics) == {"loss", "accuracy", "accuracy_mask"}
    assert float(metrics["accuracy_mask"]) == pytest.approx(float(metrics["accuracy"]))


def test_overfits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = tiny_mlm()
    loss = fit_batch(model, {"tokens": random_blocks(4, 65), "sample_id": torch.arange(4)}, steps=150, lr=3e-3)
    assert loss < 0.05, loss


def test_refuses_bad_settings() -> None:
    causal = Transformer(vocab_size=VOCAB, max_seq_len=16, d_model=16, n_layer=1, n_head=2, causal=True)
    with pytest.raises(ValueError, match=r"model\.backbone\.causal=false"):
        MaskedLM(causal, optimizer=partial(torch.optim.AdamW))
    for key, value in [("mask_rate", 0.0), ("eval_mask_rate", 1.0), ("mask_rate", 1.5)]:
        with pytest.raises(ValueError, match=rf"model\.{key}={value} must be in \(0, 1\)"):
            tiny_mlm(**{key: value})
    with pytest.raises(ValueError, match="sum of at most 1"):
        tiny_mlm(mask_prob=0.9, random_prob=0.2)


class NoMaskTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.mask_id = None


def test_tokenizer_without_mask_token_is_refused(compose_train) -> None:
    cfg = compose_train(experiment="mlm_tiny")
    with pytest.raises(ConfigError, match="MaskedLM needs a tokenizer with the mask token"):
        build_objective(cfg.model, PackedBlocks(NoMaskTokenizer(), 64))
    assert isinstance(build_objective(cfg.model, PackedBlocks(ByteTokenizer(), 64)), MaskedLM)
