"""Shared fixtures: small real shards (a few standard-library packages), a BPE
tokenizer trained on them, and a composer for tiny, fast training configs."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pretraining.config import CONFIG_DIR
from pretraining.data.cli import train_texts
from pretraining.data.corpus import read_text_files, stdlib_root
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import train_bpe

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# A model and run small enough for a few seconds of CPU.
TINY_RUN = [
    "experiment=clm_tiny",
    "logger=csv",
    "model.backbone.d_model=32",
    "model.backbone.n_layer=1",
    "model.backbone.n_head=2",
    "model.backbone.max_seq_len=64",
    "model.warmup_steps=2",
    "data.batch_size=4",
    "data.num_workers=0",
    "data.val_blocks=8",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "callbacks.model_checkpoint.every_n_train_steps=6",
    "callbacks.text_sample.max_new_tokens=16",
]


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shards"
    packages = ("json", "email", "logging", "concurrent")
    documents = itertools.chain.from_iterable(read_text_files(stdlib_root() / name) for name in packages)
    settings = BuildSettings(validation_fraction=0.2, max_shard_bytes=100_000)
    build_shards(documents, out, [f"stdlib:{name}" for name in packages], settings, show_progress=False)
    return out


@pytest.fixture(scope="session")
def bpe_path(shard_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(train_texts(shard_dir), vocab_size=320, out_path=path)
    return path


ComposeTrain = Callable[..., DictConfig]


@pytest.fixture
def compose_train(tmp_path: Path, shard_dir: Path) -> ComposeTrain:
    """Compose configs/train.yaml for a tiny run writing into tmp_path."""

    def compose_(*overrides: str, tiny: bool = True) -> DictConfig:
        base = [f"data.dir={shard_dir}", f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs"]
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            return compose("train", overrides=[*base, *(TINY_RUN if tiny else []), *overrides])

    return compose_
