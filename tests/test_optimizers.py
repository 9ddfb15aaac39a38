"""MuonAdamW (`pretraining.objectives.optimizers`): which parameters Muon takes, its update against
torch.optim.Muon's and AdamW's against torch.optim.AdamW's, the orthogonalisation, a state_dict round trip,
the config (`model/optimizer=muon`) and its refusals, and the learning rates a run logs."""

from __future__ import annotations

import copy
import csv
import io
import logging
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from lightning.pytorch import Trainer
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.models.transformer import Transformer
from pretraining.objectives import optimizers
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.optimizers import (
    MuonAdamW,
    layer_parameters,
    orthogonalisation_dtype,
    orthogonalised,
)
from pretraining.run import check_config
from pretraining.train import train

MUON = partial(MuonAdamW, lr=1e-2, weight_decay=0.1, muon_lr=0.02, muon_weight_decay=0.1)


def backbone(causal: bool = True) -> Transformer:
    return Transformer(vocab_size=50, max_seq_len=32, d_model=32, n_layer=2, n_head=2, causal=causal)


def configured(model: nn.Module) -> dict:
    model.trainer = Trainer(max_steps=100, logger=False, enable_checkpointing=False)
    return model.configure_optimizers()


def test_muon_takes_the_matrices_inside_the_layers_only() -> None:
    model = CausalLM(backbone(), optimizer=MUON)
    adamw, no_decay, muon = configured(model)["optimizer"].param_groups
    assert [group["name"] for group in (adamw, no_decay, muon)] == ["adamw", "adamw_no_decay", "muon"]
    names = {id(p): name for name, p in model.named_parameters()}
    in_layers = {name for name, p in model.named_parameters() if name.startswith("backbone.blocks.") and p.dim() == 2}
    assert {names[id(p)] for p in muon["params"]} == in_layers and muon["muon"] and muon["initial_lr"] == 0.02
    embeddings = {"backbone.token_embedding.weight", "backbone.position_embedding.weight"}  # the head is tied
    assert {names[id(p)] for p in adamw["params"]} == embeddings
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert (adamw["weight_decay"], muon["weight_decay"]) == (0.1, 0.1)
    assert sum(len(group["params"]) for group in (adamw, no_decay, muon)) == len(list(model.parameters()))


def test_a_contrastive_projection_and_temperature_stay_with_adamw() -> None:
    model = Contrastive(backbone(causal=False), optimizer=MUON, shared_towers=False, embed_dim=16)
    hidden = {id(p) for p in layer_parameters(model) if p.dim() == 2}
    outside = [name for name, p in model.named_parameters() if id(p) not in hidden]
    assert {"logit_scale", "query_head.weight", "passage_head.weight"} <= set(outside)
    assert len(hidden) == 2 * 2 * sum(p.dim() == 2 for p in backbone().blocks[0].parameters())  # 2 towers x 2 layers
    (muon,) = [group for group in configured(model)["optimizer"].param_groups if group.get("muon")]
    assert {id(p) for p in muon["params"]} == hidden


def test_adamw_keeps_its_two_unnamed_groups() -> None:
    """As before Muon: old checkpoints resume into it and the LR monitor's names (lr-AdamW/pg1) stay."""
    model = CausalLM(backbone(), optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1))
    groups = configured(model)["optimizer"].param_groups
    assert len(groups) == 2 and not any("name" in group or "muon" in group for group in groups)


@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (128, 48)])
def test_orthogonalised_singular_values_are_near_one(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    matrix = torch.randn(shape) * 1e-3  # singular values from about 0.3e-3 to 2e-3
    update = orthogonalised(matrix, 5, torch.float32)
    assert update.dtype == torch.float32 and update.shape == matrix.shape
    singular = torch.linalg.svdvals(update)
    assert singular.min() > 0.6 and singular.max() < 1.25, singular  # the quintic's band, not exactly 1


def test_float32_off_cuda_bfloat16_on_cuda() -> None:
    assert orthogonalisation_dtype(torch.device("cpu")) == torch.float32
    assert orthogonalisation_dtype(torch.device("cuda", 0)) == torch.bfloat16


def two_layer_problem() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6)), torch.randn(16, 12)


def muon_adamw(model: nn.Sequential, muon_lr: float = 0.05) -> MuonAdamW:
    """Muon on the first layer's weight, AdamW (with and without weight decay) on the rest."""
    first, bias, last, last_bias = model[0].weight, model[0].bias, model[2].weight, model[2].bias
    groups = [{"params": [last]}, {"params": [bias, last_bias], "weight_decay": 0.0}, {"params": [first], "muon": True}]
    return MuonAdamW(groups, lr=1e-2, weight_decay=0.1, muon_lr=muon_lr, muon_weight_decay=0.1)


def train_steps(model: nn.Sequential, inputs: torch.Tensor, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()


def test_muon_and_adamw_steps_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's bfloat16 orthogonalisation, the Muon group steps bitwise as torch.optim.Muon and the
    others as torch.optim.AdamW."""
    monkeypatch.setattr(optimizers, "orthogonalisation_dtype", lambda device: torch.bfloat16)
    model, inputs = two_layer_problem()
    reference = copy.deepcopy(model)
    train_steps(model, inputs, muon_adamw(model), 3)

    muon = torch.optim.Muon([reference[0].weight], lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)
    biases = [reference[0].bias, reference[2].bias]
    adamw_groups = [{"params": [reference[2].weight], "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(adamw_groups, lr=1e-2)
    for _ in range(3):
        muon.zero_grad()
        adamw.zero_grad()
        reference(inputs).square().mean().backward()
        muon.step()
        adamw.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_a_state_dict_round_trip_gives_the_same_next_steps() -> None:
    model, inputs = two_layer_problem()
    optimizer = muon_adamw(model)
    train_steps(model, inputs, optimizer, 3)
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    restored_model = copy.deepcopy(model)
    restored = muon_adamw(restored_model, muon_lr=1.0)  # the saved param groups win
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert restored.param_groups[2]["lr"] == 0.05 and "momentum_buffer" in restored.state[restored_model[0].weight]
    train_steps(model, inputs, optimizer, 2)
    train_steps(restored_model, inputs, restored, 2)
    for ours, theirs in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_a_muon_group_takes_whole_matrices_only() -> None:
    with pytest.raises(ValueError, match="not a matrix"):
        MuonAdamW([{"params": [nn.Parameter(torch.zeros(3))], "muon": True}])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a mesh of this process
    try:
        sharded = distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(ValueError, match="sharded"):
            MuonAdamW([{"params": [nn.Parameter(sharded)], "muon": True}])
    finally:
        dist.destroy_process_group()


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["experiment=clm_tiny", "data.dir=/data", *overrides])


@pytest.mark.parametrize("experiment", ["clm_tiny", "mlm_tiny", "contrastive_tiny"])
def test_muon_composes_with_each_objective_and_keeps_its_adamw_settings(experiment: str) -> None:
    cfg = composed(f"experiment={experiment}", "model/optimizer=muon", "model.schedule=wsd")
    check_config(cfg)
    adamw = composed(f"experiment={experiment}").model.optimizer
    assert cfg.model.optimizer._target_ == "pretraining.objectives.optimizers.MuonAdamW"
    assert cfg.model.optimizer.muon_lr == 0.02
    for key in ("lr", "betas", "eps", "weight_decay"):  # the objective's, as with AdamW
        assert cfg.model.optimizer[key] == adamw[key]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.optimizer.muon_lr=-0.1", r"model.optimizer.muon_lr=-0.1 must be > 0"),
        ("model.optimizer.lr=-1", r"model.optimizer.lr=-1 must be > 0"),
        ("model.optimizer.muon_momentum=1.0", r"model.optimizer.muon_momentum=1.0 must be in \[0, 1\)"),
        ("model.optimizer.muon_ns_steps=0", r"model.optimizer.muon_ns_steps=0 must be in \[1, 99\]"),
        ("model.optimizer.muon_weight_decay=-1", r"model.optimizer.muon_weight_decay=-1 must be at least 0"),
        ("model.optimizer.muon_lr_scaling=rms", r"model.optimizer.muon_lr_scaling='rms' is not one of"),
        ("trainer=fsdp_cpu", r"^model/optimizer=muon needs whole matrices.*choose trainer=ddp"),
    ],
)
def test_bad_muon_settings_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(composed("model/optimizer=muon", override))


def test_a_muon_run_logs_both_learning_rates_under_the_schedule(compose_train, tmp_path: Path) -> None:
    overrides = ["model/optimizer=muon", "model.schedule=wsd", "model.decay_steps=4", "trainer.max_steps=8"]
    train(compose_train(*overrides, "trainer.log_every_n_steps=1"))
    with (tmp_path / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("lr-MuonAdamW/muon")]
    muon = [float(row["lr-MuonAdamW/muon"]) for row in rows]
    adamw = [float(row["lr-MuonAdamW/adamw"]) for row in rows]
    assert len(muon) == 8 and all(row["lr-MuonAdamW/adamw_no_decay"] for row in rows)
    assert muon[:2] == pytest.approx([0.01, 0.02]) and muon[3] == pytest.approx(0.02)  # warmup 2, then the peak
    assert muon[3] > muon[4] > muon[5] > muon[6] > muon[7] == pytest.approx(0.1 * 0.02)  # the last 4: to the floor
    assert [m / a for m, a in zip(muon, adamw, strict=True)] == pytest.approx([0.02 / 3e-3] * 8)  # one multiplier


def test_a_checkpoint_continues_only_with_the_optimizer_it_was_trained_with() -> None:
    muon, adamw = CausalLM(backbone(), optimizer=MUON), CausalLM(backbone(), optimizer=partial(torch.optim.AdamW))
    states = {"muon": configured(muon)["optimizer"].state_dict(), "adamw": configured(adamw)["optimizer"].state_dict()}
    saved = {name: {"global_step": 3, "optimizer_states": [state]} for name, state in states.items()}
    muon.on_load_checkpoint(saved["muon"])
    adamw.on_load_checkpoint(saved["adamw"])
    adamw.on_load_checkpoint({"global_step": 3})  # weights alone: nothing to compare
    with pytest.raises(
        ConfigError, match=r"^the checkpoint was trained with model/optimizer=muon, and this run builds"
    ):
        adamw.on_load_checkpoint(saved["muon"])
    with pytest.raises(ConfigError, match=r"^the checkpoint was trained with model/optimizer=adamw, .* or start a"):
        muon.on_load_checkpoint(saved["adamw"])


def test_lr_scale_moves_both_peak_learning_rates() -> None:
    model = CausalLM(backbone(), optimizer=partial(MUON, lr_scale=0.5))
    adamw, no_decay, muon = configured(model)["optimizer"].param_groups
    assert (adamw["initial_lr"], no_decay["initial_lr"], muon["initial_lr"]) == (0.5e-2, 0.5e-2, 0.01)
    assert composed("model/optimizer=muon").model.optimizer.lr_scale == 1.0  # the presets' rates as they were


def test_a_resume_says_which_optimizer_settings_it_keeps(caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's param groups replace the run's (torch's load_state_dict, which Lightning calls): one line
    per model.optimizer key that has no effect, naming the value asked and the value kept."""
    saved = configured(CausalLM(backbone(), optimizer=MUON))["optimizer"].state_dict()
    changed = partial(MUON, muon_lr=0.05, betas=(0.9, 0.95), muon_momentum=0.9)
    optimizer = configured(CausalLM(backbone(), optimizer=changed))["optimizer"]
    caplog.set_level(logging.INFO)
    optimizer.load_state_dict(copy.deepcopy(saved))
    kept = [record.getMessage() for record in caplog.records if "the resumed run keeps" in record.getMessage()]
    assert kept == [
        "model.optimizer.betas: this run asks (0.9, 0.95), but the resumed run keeps the (0.9, 0.999) it trained "
        "with (a run continues its optimizer's settings; a separate run, run_name=<new name>, trains with new ones)",
        f"model.optimizer.muon_lr: this run asks 0.05, but the resumed run keeps the 0.02 it trained with {KEPT_FIX}",
        f"model.optimizer.muon_momentum: this run asks 0.9, but the resumed run keeps the 0.95 it trained with "
        f"{KEPT_FIX}",
    ]
    assert optimizer.param_groups[2]["initial_lr"] == 0.02  # as documented: the run keeps its LR
    caplog.clear()
    same = configured(CausalLM(backbone(), optimizer=MUON))["optimizer"]
    same.load_state_dict(copy.deepcopy(saved))
    assert "the resumed run keeps" not in caplog.text


KEPT_FIX = "(a run continues its optimizer's settings; a separate run, run_name=<new name>, trains with new ones)"


def test_a_resumed_adamw_run_names_its_kept_learning_rate(compose_train, caplog: pytest.LogCaptureFixture) -> None:
    train(compose_train("trainer.max_steps=4", "callbacks.checkpoint.every_n_steps=4", "trainer.val_check_interval=4"))
    caplog.set_level(logging.INFO)
    train(compose_train("trainer.max_steps=6", "trainer.val_check_interval=4", "model.optimizer.lr=0.01"))
    assert (
        f"model.optimizer.lr: this run asks 0.01, but the resumed run keeps the 0.003 it trained with {KEPT_FIX}"
        in (caplog.text)
    )
