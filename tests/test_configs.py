"""Every option of every config group composes and instantiates; every experiment preset passes the
config checks, and the large ones have the size they state; run directories are unique."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from omegaconf import DictConfig, OmegaConf

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.objectives.base import PretrainingObjective
from pretraining.run import FILLED_BY_THE_RUN, check_config, unset_keys

CORE_GROUPS = {"data", "tokenizer", "model", "trainer", "callbacks", "logger", "experiment", "debug"}
GROUPS = sorted(
    path.name for path in CONFIG_DIR.iterdir() if path.is_dir() and path.name not in {"hydra", "local", "paths"}
)
GPU_ONLY = {("trainer", "fsdp1")}  # Lightning's classic FSDP needs CUDA to build: tests/test_launch.py composes it
OPTIONS = [
    (group, path.stem)
    for group in GROUPS
    for path in sorted((CONFIG_DIR / group).glob("*.yaml"))
    if (group, path.stem) not in GPU_ONLY
]


def test_every_group_has_options() -> None:
    assert {group for group, _ in OPTIONS} == set(GROUPS) >= CORE_GROUPS
    assert {(group, path.stem) for group in GROUPS for path in (CONFIG_DIR / group).glob("*.yaml")} >= GPU_ONLY


def on_test_data(cfg: DictConfig, bpe_path: Path) -> DictConfig:
    """`cfg` (composed by `compose_train`, so on the test shards) made to run on this machine: the test
    BPE where a BPE is read from the text shards (the pair shards hold their own) or a model directory's
    tokenizer, a stand-in for each value
    left to you, and the CPU for a GPU trainer (CUDA or Apple's) when there is no such GPU (the rest of the
    trainer preset is still instantiated)."""
    if cfg.tokenizer._target_.endswith("BPETokenizer") and cfg.data.format._target_.endswith("PackedBlocks"):
        cfg.tokenizer.path = str(bpe_path)
    if cfg.tokenizer._target_.endswith("ModelTokenizer"):  # a model directory's: the test BPE, its EOS named
        directory = bpe_path.parent / "model"
        directory.mkdir(exist_ok=True)
        shutil.copy(bpe_path, directory / "tokenizer.json")
        (directory / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
        cfg.tokenizer.path = str(directory)
    for key in set(unset_keys(cfg)) - FILLED_BY_THE_RUN:  # left to you (a teacher, a directory): read by a run only
        OmegaConf.update(cfg, key, "stand-in")
    absent = {"gpu": not torch.cuda.is_available(), "mps": not torch.backends.mps.is_available()}
    if absent.get(cfg.trainer.accelerator):
        cfg.trainer.accelerator = "cpu"
    return cfg


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group: str, option: str, compose_train, bpe_path: Path) -> None:
    cfg = on_test_data(compose_train(f"{group}={option}", tiny=False), bpe_path)
    tokenizer = instantiate(cfg.tokenizer)
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    model = instantiate(cfg.model, backbone={"vocab_size": tokenizer.vocab_size})
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    loggers = [instantiate(logger) for logger in cfg.logger.values()]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
    assert isinstance(model, PretrainingObjective)
    assert isinstance(trainer, Trainer)
    lengths = datamodule.format.lengths.values()
    assert lengths and max(lengths) <= model.backbone.max_seq_len
    assert model.backbone.vocab_size == tokenizer.vocab_size


EXPERIMENTS = sorted(path.stem for path in (CONFIG_DIR / "experiment").glob("*.yaml"))  # what experiment=glob(*) picks
# The presets sized for a GPU node: the vocabulary their header assumes and the parameters (millions) it states.
LARGE = {"gpt2_124m": (50257, 124.4), "bert_base": (30522, 108.4), "contrastive_code": (32768, 110.7)}
NODE_GPUS = 8  # the node the large presets are written for


def test_large_presets_exist() -> None:
    assert set(LARGE) <= set(EXPERIMENTS)  # a renamed preset must not drop out of the checks below


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_preset_passes_checks(name: str, compose_train, bpe_path: Path) -> None:
    """Every preset composes, passes the cross-group checks and splits its global batch over the devices
    it is written for (one for the tiny presets, a node of GPUs for the large ones)."""
    cfg = on_test_data(compose_train(f"experiment={name}", tiny=False), bpe_path)
    check_config(cfg)
    datamodule = instantiate(cfg.data, tokenizer=instantiate(cfg.tokenizer))
    datamodule.plan_for(NODE_GPUS if name in LARGE else 1)  # raises if the devices cannot share the batch


@pytest.mark.parametrize("name", sorted(LARGE))
def test_large_preset_has_its_stated_size(name: str) -> None:
    vocab_size, millions = LARGE[name]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={name}"])
    with pytest.raises(ConfigError, match=r"data\.dir is not set"):  # your corpus, never the default one
        check_config(cfg)
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    with torch.device("meta"):  # shapes only: no memory, no time
        model = instantiate(cfg.model, backbone={"vocab_size": vocab_size})
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions


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


def test_cfg_job_resolve_prints_the_directories_the_run_gets(tmp_path: Path) -> None:
    """`--cfg job` runs no job, so Hydra sets no runtime.output_dir: the run's directory is hydra.run.dir."""
    command = [
        sys.executable,
        "-m",
        "pretraining",
        "--cfg",
        "job",
        "--resolve",
        "run_name=x",
        f"paths.log_dir={tmp_path}",
    ]
    printed = OmegaConf.create(subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout)
    assert printed.paths.output_dir == str(tmp_path / "train" / "runs" / "x")
    assert (
        printed.paths.checkpoint_dir
        == f"{printed.paths.output_dir}/checkpoints"
        == printed.callbacks.checkpoint.dirpath
    )
    assert printed.trainer.default_root_dir == printed.paths.output_dir
