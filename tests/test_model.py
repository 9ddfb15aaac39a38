"""The backbone and the next-token objective."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer

from conftest import fit_batch
from pretraining.errors import ConfigError
from pretraining.models import backbone as backbone_module
from pretraining.models.transformer import Transformer, parameter_count
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.schedules import warmup_cosine


def tiny_lm(**backbone: object) -> CausalLM:
    settings = {"vocab_size": 50, "max_seq_len": 32, "d_model": 32, "n_layer": 2, "n_head": 2, **backbone}
    return CausalLM(Transformer(**settings), optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))


def test_overfits_a_fixed_batch() -> None:
    torch.manual_seed(0)
    model = tiny_lm()
    loss = fit_batch(model, {"tokens": torch.randint(4, 50, (4, 33))}, steps=200, lr=1e-2)
    assert loss < 0.05, loss


def test_causal_attention_ignores_the_future() -> None:
    torch.manual_seed(0)
    model = tiny_lm().eval()
    tokens = torch.randint(4, 50, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = 4
    assert torch.equal(model(tokens)[0, :10], model(changed)[0, :10])
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_bidirectional_backbone_sees_the_future() -> None:
    backbone = Transformer(vocab_size=50, max_seq_len=16, d_model=32, n_layer=1, n_head=2, causal=False).eval()
    tokens = torch.randint(4, 50, (1, 16))
    changed = tokens.clone()
    changed[0, -1] = 4
    assert not torch.allclose(backbone(tokens)[0, 0], backbone(changed)[0, 0])


@pytest.mark.parametrize("causal", [True, False])
def test_rotary_attention_depends_on_offsets_only(causal: bool) -> None:
    """Rotary positions: moving the whole sequence along changes nothing (scores depend on the offset
    between positions), while swapping two tokens changes what their neighbours read; learned
    positions are absolute, and the shifted sequence reads differently. No position table is kept."""
    torch.manual_seed(0)
    tokens = torch.randint(4, 64, (2, 24))
    rotary = Transformer(
        vocab_size=64, max_seq_len=64, d_model=32, n_layer=2, n_head=2, causal=causal, positions="rotary"
    )
    learned = Transformer(vocab_size=64, max_seq_len=64, d_model=32, n_layer=2, n_head=2, causal=causal)
    shifted = torch.arange(24) + 9
    with torch.no_grad():
        torch.testing.assert_close(rotary.eval()(tokens, position_ids=shifted), rotary(tokens), rtol=0, atol=1e-5)
        assert not torch.allclose(learned.eval()(tokens, position_ids=shifted), learned(tokens), atol=1e-3)
        swapped = tokens[:, [1, 0, *range(2, 24)]]
        assert not torch.allclose(rotary(swapped)[:, 2], rotary(tokens)[:, 2], atol=1e-4)
    assert (
        "position_embedding.weight" not in rotary.state_dict() and "position_embedding.weight" in learned.state_dict()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert rotary(tokens).isfinite().all()  # queries rotated in bfloat16 meet bfloat16 values


def test_positions_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"positions='sinusoidal' must be one of learned, rotary"):
        Transformer(vocab_size=64, positions="sinusoidal")
    with pytest.raises(ConfigError, match=r"d_model=36 / n_head=4 is odd: choose an even head width"):
        Transformer(vocab_size=64, d_model=36, n_head=4, positions="rotary")


@pytest.mark.parametrize(("bias", "positions"), [(False, "learned"), (True, "rotary")])
def test_the_parameters_are_counted_before_the_model_is_built(bias: bool, positions: str) -> None:
    sizes = {"vocab_size": 100, "max_seq_len": 48, "d_model": 32, "n_layer": 3, "bias": bias, "positions": positions}
    built = Transformer(**sizes, n_head=2)
    assert parameter_count(**sizes) == sum(parameter.numel() for parameter in built.parameters())


def test_a_model_larger_than_the_machines_memory_is_refused_before_allocating(monkeypatch) -> None:
    monkeypatch.setattr(backbone_module, "physical_memory", lambda: 2**30)
    # 2^24 learned positions (the most max_seq_len admits) of width 128: an 8 GiB table, refused instead of allocated.
    message = r"makes 2,148,304,000 parameters, 8\.0 GiB in float32, and this machine has 1\.0 GiB of memory"
    with pytest.raises(ConfigError, match=message):
        Transformer(vocab_size=256, max_seq_len=2**24)
    Transformer(vocab_size=256, max_seq_len=2**24, positions="rotary")  # no table: rotary angles are computed


def test_tied_head_padded_vocab_and_scaled_residual_init() -> None:
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=100, max_seq_len=16, d_model=64, n_layer=8, n_head=4)
    assert backbone.token_embedding.weight.shape[0] == 128
    logits = backbone.logits(backbone(torch.zeros(1, 4, dtype=torch.long)))
    assert logits.shape == (1, 4, 128)
    logits.sum().backward()
    assert backbone.token_embedding.weight.grad is not None  # the head is the embedding
    assert not any(name.startswith("lm_head") for name, _ in backbone.named_parameters())
    projection_std = backbone.blocks[0].mlp.down.weight.std().item()
    assert projection_std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert backbone.blocks[0].mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_causal_lm_refuses_bidirectional_backbone() -> None:
    with pytest.raises(ValueError, match="causal=true"):
        tiny_lm(causal=False)


def test_weight_decay_only_on_matrices_and_schedule() -> None:
    model = tiny_lm()
    model.trainer = Trainer(max_steps=100, logger=False, enable_checkpointing=False)
    model.warmup_steps = 10
    config = model.configure_optimizers()
    decayed, plain = config["optimizer"].param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert config["lr_scheduler"]["interval"] == "step"


def test_warmup_cosine() -> None:
    schedule = partial(warmup_cosine, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)


def test_validation_metrics_come_from_sums() -> None:
    model = tiny_lm()
    totals = {"nll": torch.tensor(60.0), "tokens": torch.tensor(30.0), "bytes": torch.tensor(40.0)}
    metrics = model.validation_metrics(totals)
    assert metrics["loss"].item() == pytest.approx(2.0)
    assert metrics["ppl"].item() == pytest.approx(math.exp(2.0))
    assert metrics["bpb"].item() == pytest.approx(60.0 / (math.log(2) * 40.0))


def test_generate_respects_context_and_vocab() -> None:
    torch.manual_seed(0)
    model = tiny_lm().eval()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=40, top_k=5)
    assert out.shape[1] <= 43 and torch.equal(out[0, :3], torch.tensor([5, 6, 7]))
    assert int(out.max()) < 50  # never a padded id
