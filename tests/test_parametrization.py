"""The parametrization switch (`pretraining.models.parametrization`): identity at the base shape, each rule at a
larger one (init, multipliers, param groups) for both backbones and both optimizers, its refusals, and a resume
or a stage two under other rules refused."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from pretraining.cli import info as info_main
from pretraining.errors import ConfigError
from pretraining.init_from import check_same_backbone
from pretraining.models.backbone import Backbone
from pretraining.models.llama import Llama
from pretraining.models.parametrization import STANDARD, check_same_parametrization
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.optimizers import MuonAdamW
from pretraining.train import train

ADAMW = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-8)
MUON = partial(MuonAdamW, lr=1e-2, weight_decay=0.1, eps=1e-8, muon_lr=0.02)
BACKBONES = {"gpt2": Transformer, "llama": partial(Llama, output_init="scaled")}
MUP = ["model.backbone.parametrization=mup", "model.backbone.base_width=16"]  # twice the base width of 32


def built(kind: str, **sizes: Any) -> Backbone:
    shape = {"vocab_size": 64, "max_seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 2} | sizes
    return BACKBONES[kind](**shape)  # type: ignore[no-any-return]


def configured(model: PretrainingObjective) -> torch.optim.Optimizer:
    model.trainer = Trainer(max_steps=100, logger=False, enable_checkpointing=False)
    return model.configure_optimizers()["optimizer"]


def groups(model: PretrainingObjective) -> dict[str, dict[str, Any]]:
    return {group.get("name", str(index)): group for index, group in enumerate(configured(model).param_groups)}


def losses(model: CausalLM, steps: int = 3) -> list[float]:
    optimizer = configured(model)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    values = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model.training_loss({"tokens": tokens})
        loss.backward()
        optimizer.step()
        values.append(loss.item())
    return values


@pytest.mark.parametrize("kind", BACKBONES)
@pytest.mark.parametrize("optimizer", [ADAMW, MUON], ids=["adamw", "muon"])
@pytest.mark.parametrize("name", ["mup", "completep"])
def test_at_the_base_shape_the_rules_train_exactly_as_standard(kind: str, optimizer: Any, name: str) -> None:
    """A sweep at the base shape is a sweep of every parametrization."""
    torch.manual_seed(0)
    standard = CausalLM(built(kind), optimizer=optimizer)
    torch.manual_seed(0)
    scaled = CausalLM(built(kind, parametrization=name, base_width=32, base_depth=2), optimizer=optimizer)
    assert losses(scaled) == losses(standard)


def test_each_rule_at_four_times_the_width_and_twice_the_depth() -> None:
    """completep at 4x the base width and 2x its depth: init, attention's scale, branch and output multipliers,
    and the param groups' learning rate, eps and weight decay (Dey et al. 2025, Table 1; nanoGPT-mup)."""
    torch.manual_seed(0)
    wide = built("gpt2", d_model=128, n_layer=4, parametrization="completep", base_width=32, base_depth=2)
    rules = wide.parametrization
    assert (rules.width_multiplier, rules.depth_multiplier, rules.output_multiplier) == (4.0, 2.0, 0.25)
    block = wide.blocks[0]
    assert block.branch_multiplier == 0.5
    assert block.attention.scale == pytest.approx(math.sqrt(16) / 64)  # sqrt(base head width) / head width
    assert wide.blocks[0].mlp.up.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    # The residual projections start as at the base depth: 0.02 / sqrt(4) / sqrt(2 x 2).
    assert block.mlp.down.weight.std().item() == pytest.approx(0.02 / 2 / 2, rel=0.05)
    assert wide.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    named = groups(CausalLM(wide, optimizer=ADAMW))
    assert list(named) == ["embeddings", "hidden", "layer_vectors", "vectors"]
    hidden, embeddings = named["hidden"], named["embeddings"]
    assert (hidden["initial_lr"], hidden["eps"], hidden["weight_decay"]) == pytest.approx((2.5e-3, 1.25e-9, 0.4))
    assert (embeddings["initial_lr"], embeddings["eps"], embeddings["weight_decay"]) == pytest.approx(
        (1e-2, 2.5e-9, 0.1)
    )
    assert named["layer_vectors"]["eps"] == pytest.approx(1.25e-9) and named["vectors"]["eps"] == pytest.approx(2.5e-9)


def test_mup_scales_width_only_and_muon_keeps_its_rate() -> None:
    wide = built("llama", d_model=128, n_layer=4, parametrization="mup", base_width=32, base_depth=2)
    assert wide.parametrization.depth_multiplier == 1.0 and wide.layers[0].branch_multiplier == 1.0
    named = groups(CausalLM(wide, optimizer=MUON))
    assert list(named) == ["embeddings", "layer_vectors", "vectors", "muon"]
    assert named["muon"]["initial_lr"] == 0.02 and named["muon"]["weight_decay"] == 0.0
    assert named["embeddings"]["initial_lr"] == 1e-2 and named["embeddings"]["eps"] == pytest.approx(2.5e-9)
    hidden = {id(p) for layer in wide.layers for p in layer.parameters() if p.dim() == 2}
    assert {id(p) for p in named["muon"]["params"]} == hidden


def test_the_head_reads_the_final_states_times_the_output_multiplier() -> None:
    torch.manual_seed(0)
    wide = built("llama", d_model=64, parametrization="mup", base_width=32)
    hidden = torch.randn(3, 64)
    assert torch.allclose(wide.logits(hidden), hidden @ wide.head_weight.T / 2)


def test_a_head_width_of_its_own_keeps_standard_attention() -> None:
    wide = built("llama", d_model=64, head_dim=16, parametrization="mup", base_width=32)
    assert wide.layers[0].self_attn.scale is None


def test_standard_ignores_the_base_and_builds_as_before() -> None:
    torch.manual_seed(0)
    plain = built("gpt2")
    torch.manual_seed(0)
    based = built("gpt2", base_width=8, base_depth=1)
    assert based.parametrization is STANDARD
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), based.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ({"parametrization": "mu-p"}, "must be one of standard, mup, completep"),
        ({"parametrization": "mup"}, "set model.backbone.base_width to the d_model"),
        ({"parametrization": "mup", "base_width": 15}, "base_width=15 does not split into base_n_head=2 heads"),
        ({"parametrization": "completep", "base_width": 32}, "set model.backbone.base_depth"),
    ],
)
@pytest.mark.parametrize("kind", BACKBONES)
def test_settings_that_scale_nothing_are_refused(kind: str, sizes: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        built(kind, **sizes)


def test_an_optimizer_of_other_rules_is_refused() -> None:
    wide = built("gpt2", d_model=64, parametrization="mup", base_width=32)
    with pytest.raises(ConfigError, match=r"scales AdamW's and Muon's settings, and model.optimizer builds SGD"):
        CausalLM(wide, optimizer=partial(torch.optim.SGD, lr=0.1))
    CausalLM(built("gpt2"), optimizer=partial(torch.optim.SGD, lr=0.1))  # standard takes any


def test_a_checkpoint_of_other_rules_is_refused_naming_both() -> None:
    wide = built("gpt2", d_model=64, parametrization="mup", base_width=32).parametrization
    summary = "mup at 2x its base width, heads 2x as wide as the base's"
    assert wide.record() == {
        "name": "mup",
        "width_multiplier": 2.0,
        "depth_multiplier": 1.0,
        "head_multiplier": 2.0,
    } | {"summary": summary}
    check_same_parametrization(wide.record(), wide.record())
    with pytest.raises(ConfigError, match=r"trained under model.backbone.parametrization=mup at 2x its base width, "):
        check_same_parametrization(wide.record(), STANDARD.record())
    check_same_parametrization(None, STANDARD.record())  # a checkpoint from before parametrizations: standard
    with pytest.raises(ConfigError, match="this run builds mup at 2x its base width"):
        check_same_parametrization(None, wide.record())
    other_heads = built("gpt2", d_model=64, parametrization="mup", base_width=32, base_n_head=1).parametrization
    with pytest.raises(
        ConfigError, match=r"heads 2x as wide as the base's, and this run builds mup at 2x its base width:"
    ):
        check_same_parametrization(wide.record(), other_heads.record())  # the same width, other heads at the base


def test_the_lineage_records_the_rules_and_info_shows_them(
    compose_train, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train(compose_train("trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2", *MUP))
    lineage = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["lineage"]
    assert lineage["parametrization"]["summary"] == "mup at 2x its base width, heads 2x as wide as the base's"
    info_main([str(tmp_path / "checkpoints" / "last.ckpt")])
    assert "CausalLM, mup at 2x its base width, heads 2x as wide" in capsys.readouterr().out  # the model row


def test_a_stage_two_from_a_parent_of_other_rules_is_refused() -> None:
    parent, child = built("gpt2"), built("gpt2", parametrization="mup", base_width=16)
    with pytest.raises(ConfigError, match="was trained under standard and this run builds mup at 2x its base width"):
        check_same_backbone(parent, child, "parent.ckpt")


@pytest.mark.parametrize("head_dim", [None, 16])
def test_widening_by_adding_heads_keeps_their_scale(head_dim: int | None) -> None:
    """From 2 heads of 16 to 4 of 16: the base's head count named (or a head width of its own), the scores' scale
    stays standard's; this run's count taken for the base's, they would be read as heads twice as wide."""
    sizes = {"d_model": 64, "n_head": 4, "parametrization": "mup", "base_width": 32}
    llama = built("llama", **sizes, head_dim=head_dim, base_n_head=2)
    assert llama.layers[0].self_attn.scale is None
    gpt2 = built("gpt2", **sizes, base_n_head=2)
    assert gpt2.blocks[0].attention.scale is None and gpt2.parametrization.width_multiplier == 2.0
    assert built("gpt2", **sizes).blocks[0].attention.scale == pytest.approx(1 / (4 * math.sqrt(2)))


def test_a_contrastive_projection_is_a_readout_and_its_temperature_keeps_its_rate() -> None:
    model = Contrastive(built("gpt2", d_model=64, causal=False, parametrization="mup", base_width=32), optimizer=ADAMW)
    named = groups(model)
    assert {id(p) for p in named["readouts"]["params"]} == {id(model.query_head.weight)}
    assert named["readouts"]["initial_lr"] == pytest.approx(5e-3) and named["readouts"]["weight_decay"] == 0.1
    scalars = named["objective_vectors"]
    assert {id(p) for p in scalars["params"]} == {id(model.logit_scale)}
    assert (scalars["initial_lr"], scalars["eps"], scalars["weight_decay"]) == (1e-2, 1e-8, 0.0)


def test_two_towers_share_their_rules_and_their_groups() -> None:
    encoder = built("llama", d_model=64, causal=False, parametrization="completep", base_width=32, base_depth=1)
    model = Contrastive(encoder, optimizer=MUON, shared_towers=False, embed_dim=16)
    named = groups(model)
    towers = [model.backbone, model.passage_backbone]
    hidden = {id(p) for tower in towers for layer in tower.layers for p in layer.parameters() if p.dim() == 2}
    assert {id(p) for p in named["muon"]["params"]} == hidden
    heads = {id(model.query_head.weight), id(model.passage_head.weight)}
    assert {id(p) for p in named["readouts"]["params"]} == heads


def test_muon_scaled_to_match_adamw_is_refused() -> None:
    wide = built("gpt2", d_model=64, parametrization="mup", base_width=32)
    with pytest.raises(ConfigError, match="muon_lr_scaling=match_rms_adamw grows with the width: set it to original"):
        CausalLM(wide, optimizer=partial(MuonAdamW, muon_lr_scaling="match_rms_adamw"))
