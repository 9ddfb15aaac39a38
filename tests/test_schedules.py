"""The LR schedules (`pretraining.objectives.schedules`): cosine as before, warmup-stable-decay's phases,
its continuation with another trainer.max_steps (exact in the stable phase, refused in the decay), and the
schedule keys of the config."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.objectives.schedules import WarmupStableDecay, lr_schedule, warmup_cosine, warmup_stable_decay
from pretraining.run import check_config, fit_schedule


def test_cosine_is_a_lambda_lr_of_warmup_cosine_as_before() -> None:
    """The state of a LambdaLR, as checkpoints before wsd hold, and the same multipliers."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = lr_schedule(optimizer, "cosine", warmup_steps=10, min_lr_ratio=0.1, decay_steps=7, total_steps=110)
    assert isinstance(scheduler, LambdaLR) and "decay_start" not in scheduler.state_dict()
    expected = partial(warmup_cosine, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    rates = []
    for _ in range(120):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == [expected(step) for step in range(120)]


def test_warmup_stable_decay_phases() -> None:
    schedule = partial(warmup_stable_decay, warmup_steps=10, decay_start=80, decay_steps=20, min_lr_ratio=0.1)
    assert [schedule(step) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warmup
    assert all(schedule(step) == 1.0 for step in range(9, 80))  # the peak, until the decay starts
    assert schedule(80) == pytest.approx(0.1 + 0.9 * (1 - 0.05**0.5))  # the decay's first step
    assert schedule(84) == pytest.approx(0.1 + 0.9 * (1 - 0.5))  # 1 - sqrt(progress): a quarter of the way
    assert schedule(98) > schedule(99) == pytest.approx(0.1) == schedule(500)  # the decay's last step: the floor


def wsd(total_steps: int, decay_steps: int = 20) -> tuple[torch.optim.Optimizer, WarmupStableDecay]:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return optimizer, WarmupStableDecay(optimizer, 10, decay_steps, total_steps, min_lr_ratio=0.1)


def advance(optimizer: torch.optim.Optimizer, scheduler: WarmupStableDecay) -> None:
    """One training step's calls, in Lightning's order (no gradients: the optimizer changes nothing)."""
    optimizer.step()
    scheduler.step()


def rates_after(total_steps: int, steps: int, then: int, decay_steps: int = 20) -> list[float]:
    """The LRs of steps `steps` to `steps + then` of a schedule over `total_steps`."""
    optimizer, scheduler = wsd(total_steps, decay_steps)
    rates = []
    for step in range(steps + then):
        if step >= steps:
            rates.append(optimizer.param_groups[0]["lr"])
        advance(optimizer, scheduler)
    return rates


def saved_at(step: int, total_steps: int, decay_steps: int = 20) -> dict:
    """The (optimizer, scheduler) states of a schedule over `total_steps` after `step` steps."""
    optimizer, scheduler = wsd(total_steps, decay_steps)
    for _ in range(step):
        advance(optimizer, scheduler)
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def resumed(saved: dict, total_steps: int, then: int, decay_steps: int = 20) -> list[float]:
    """The next `then` LRs after `saved`, continued by a schedule over `total_steps`, restored as Lightning
    does (the optimizer, whose param groups carry the next LR, then the scheduler)."""
    optimizer, scheduler = wsd(total_steps, decay_steps)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rates = []
    for _ in range(then):
        rates.append(optimizer.param_groups[0]["lr"])
        advance(optimizer, scheduler)
    return rates


def test_the_state_records_the_decay_and_the_phase() -> None:
    assert {"decay_start": 80, "decay_steps": 20, "phase": "warmup"}.items() <= saved_at(5, 100)["scheduler"].items()
    assert saved_at(50, 100)["scheduler"]["phase"] == "stable"
    assert saved_at(79, 100)["scheduler"]["phase"] == "stable"  # the phase of the next step
    assert saved_at(80, 100)["scheduler"]["phase"] == "decay"


@pytest.mark.parametrize("step", [5, 50, 80])
def test_a_stable_phase_state_continues_exactly_with_more_steps(step: int) -> None:
    assert resumed(saved_at(step, 100), 300, then=300 - step) == rates_after(300, step, then=300 - step)


def test_a_cooldown_from_a_stable_phase_state() -> None:
    """The run planned 1000 steps; from step 50 it decays over the next 20 instead."""
    rates = resumed(saved_at(50, 1000), 50 + 20, then=20)
    assert rates == rates_after(70, 50, then=20) and rates[0] < 1.0 and rates[-1] == pytest.approx(0.1)


def test_the_same_decay_continues_anywhere() -> None:
    assert resumed(saved_at(90, 100), 100, then=10) == rates_after(100, 90, then=10)


def test_the_schedules_refuse_each_others_states() -> None:
    cosine_optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cosine = lr_schedule(cosine_optimizer, "cosine", warmup_steps=10, min_lr_ratio=0.1, decay_steps=7, total_steps=110)
    with pytest.raises(ConfigError, match=r"^the checkpoint was trained with model.schedule=wsd: continue it with"):
        cosine.load_state_dict(saved_at(50, 100)["scheduler"])
    with pytest.raises(ConfigError, match=r"^the checkpoint was trained with model.schedule=cosine: continue it"):
        wsd(100)[1].load_state_dict(cosine.state_dict())


def test_a_state_in_its_decay_is_refused_another_decay() -> None:
    with pytest.raises(ConfigError, match=r"^the checkpoint \(step 81\) is in its LR decay \(steps 80 to 100\): .*"):
        resumed(saved_at(81, 100), 200, then=1)
    with pytest.raises(ConfigError, match=r"continues only with trainer.max_steps=100 model.decay_steps=20"):
        resumed(saved_at(90, 100), 100, then=1, decay_steps=30)


def test_a_decay_that_would_start_before_the_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"starts the LR decay at step 40, .* at least 70 \(70: a cooldown"):
        resumed(saved_at(50, 1000), 60, then=1)


def test_a_cosine_state_is_refused_by_wsd() -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    cosine = lr_schedule(optimizer, "cosine", warmup_steps=10, min_lr_ratio=0.1, decay_steps=0, total_steps=100)
    with pytest.raises(ConfigError, match=r"model.schedule=cosine: continue it with model.schedule=cosine"):
        wsd(100)[1].load_state_dict(cosine.state_dict())


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=["data.dir=/data", *overrides])


@pytest.mark.parametrize("experiment", ["clm_tiny", "mlm_tiny", "contrastive_tiny", "gpt2_124m", "bert_base"])
def test_every_objective_takes_the_schedule_keys(experiment: str) -> None:
    cfg = composed(f"experiment={experiment}", "model.schedule=wsd", "model.decay_steps=50")
    check_config(cfg)
    assert (cfg.model.schedule, cfg.model.decay_steps) == ("wsd", 50)
    assert composed(f"experiment={experiment}").model.schedule == "cosine"  # the default, as before


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.schedule=linear", r"^model.schedule='linear' is not one of 'cosine', 'wsd': change model.schedule"),
        ("model.decay_steps=0", r"^model.decay_steps=0 must be at least 1: set model.decay_steps within"),
    ],
)
def test_bad_schedule_values_are_refused_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_config(composed("experiment=clm_tiny", override))


def test_a_decay_longer_than_the_run_is_shortened(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg = composed("experiment=clm_tiny", "model.schedule=wsd", "trainer.max_steps=20")  # warmup 30, decay 120
    fit_schedule(cfg)
    assert (cfg.model.warmup_steps, cfg.model.decay_steps) == (2, 4)
    assert "model.decay_steps=120 does not fit in trainer.max_steps=20 after model.warmup_steps=2" in caplog.text
    cosine = composed("experiment=clm_tiny", "trainer.max_steps=20")
    fit_schedule(cosine)
    assert cosine.model.decay_steps == 120  # cosine has no decay length
