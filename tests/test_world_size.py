"""The processes worked out from a Trainer config before the Trainer exists (`pretraining.world_size`) are
those of the Trainer Lightning builds from it: one device, devices on one node, torchrun's ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
from lightning.pytorch import Trainer
from omegaconf import OmegaConf

from pretraining.world_size import world_size

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
TORCHRUN = {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}


@pytest.mark.parametrize(
    ("settings", "environment", "expected"),
    [
        ({"accelerator": "auto", "devices": 1, "strategy": "auto"}, {}, 1),
        ({"accelerator": "cpu", "devices": 2, "strategy": "ddp"}, {}, 2),
        ({"accelerator": "cpu", "devices": "auto", "strategy": "ddp"}, {}, 1),
        ({"accelerator": "cpu", "devices": 2, "num_nodes": 2, "strategy": "ddp"}, TORCHRUN, 4),
    ],
)
def test_the_processes_worked_out_are_the_trainers(
    settings: dict[str, Any], environment: dict[str, str], expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [key for key in os.environ if key.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    assert world_size(OmegaConf.create(settings), []) == expected
    assert Trainer(**settings, **QUIET).world_size == expected
