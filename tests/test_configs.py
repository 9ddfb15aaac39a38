"""Every option of every config group composes and instantiates; run directories are unique."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Trainer

from pretraining.config import CONFIG_DIR, ConfigError, check_config
from pretraining.objectives import PretrainingObjective

GROUPS = ("data", "tokenizer", "model", "trainer", "callbacks", "logger", "experiment", "hparams_search", "debug")
GPU_ONLY = {("trainer", "fsdp1")}  # Lightning's classic FSDP needs CUDA to build: tests/test_launch.py composes it
OPTIONS = [
    (group, path.stem)
    for group in GROUPS
    for path in sorted((CONFIG_DIR / group).glob("*.yaml"))
    if (group, path.stem) not in GPU_ONLY
]


def test_every_group_has_options() -> None:
    assert {group for group, _ in OPTIONS} == set(GROUPS)
    assert {(group, path.stem) for group in GROUPS for path in (CONFIG_DIR / group).glob("*.yaml")} >= GPU_ONLY


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group: str, option: str, compose_train, bpe_path: Path) -> None:
    extra = [f"tokenizer.path={bpe_path}"] if option == "bpe" else []
    if option in ("gpu", "ddp", "fsdp") and not torch.cuda.is_available():
        extra.append("trainer.accelerator=cpu")  # the rest of the preset is still instantiated
    cfg = compose_train(f"{group}={option}", *extra, tiny=False)
    tokenizer = instantiate(cfg.tokenizer)
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    model = instantiate(cfg.model, backbone={"vocab_size": tokenizer.vocab_size})
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    loggers = [instantiate(logger) for logger in cfg.logger.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
    assert isinstance(model, PretrainingObjective)
    assert isinstance(trainer, Trainer)
    lengths = [
        getattr(datamodule, key) for key in ("block_size", "query_len", "passage_len") if hasattr(datamodule, key)
    ]
    assert lengths and max(lengths) <= model.backbone.max_seq_len
    assert model.backbone.vocab_size == tokenizer.vocab_size


def test_a_data_directory_of_your_own_must_be_named() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["data=text"])
    with pytest.raises(ConfigError, match=r"data\.dir is not set"):  # not "tokenizer.path", which interpolates it
        check_config(cfg)


def test_eval_config_composes() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=["ckpt_path=x.ckpt"])
    assert cfg.ckpt_path == "x.ckpt" and cfg.task_name == "eval"


def test_run_directory_layout() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["run_name=abc"], return_hydra_config=True)
    assert cfg.hydra.run.dir == f"{cfg.paths.log_dir}/train/runs/abc"
    assert cfg.paths.log_dir == str(Path(CONFIG_DIR).parent / "logs")


def test_run_names_differ_between_processes_started_together() -> None:
    code = "import pretraining.config, omegaconf; print(omegaconf.OmegaConf.create({'n': '${run_suffix:}'}).n)"
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    suffixes = [run.communicate()[0].strip() for run in runs]
    assert len(set(suffixes)) == 2 and all(len(s) == 6 for s in suffixes)
