"""The core's console commands (pyproject's `[project.scripts]`; each extra has its own `cli.py`). Each parses its
arguments, then imports its work inside the function (`tests/test_layers.py` lists deferring modules and why): torch,
Lightning and W&B take seconds to load, so `--help`, a usage error or `--cfg job` loads none of them
(`scripts/bench/bench_startup.py` measures it, `tests/test_cli.py` checks it)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pretraining.config import CONFIG_DIR
from pretraining.errors import PretrainingError
from pretraining.slurm import leave_the_notice_alone, requeue_on_early_notice


def train() -> None:
    """`pretrain`: train as the config says (continuing the run from its newest checkpoint)."""
    requeue_on_early_notice()  # first: SLURM's notice can come while Hydra's callbacks load torch
    train_from_config()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def train_from_config(cfg: DictConfig) -> float | None:
    """`pretrain`'s Hydra job (each job of a multirun)."""
    if OmegaConf.select(cfg, "callbacks.preemption.requeue", default=False):
        requeue_on_early_notice()
    else:
        leave_the_notice_alone()
    from pretraining.train import train_job

    return train_job(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
def evaluate(cfg: DictConfig) -> None:
    """`pretrain-eval ckpt_path=...`: validate a checkpoint and sample from it."""
    from pretraining.evaluate import evaluate

    evaluate(cfg)


def data(argv: Sequence[str] | None = None) -> None:
    """`pretrain-data build|tokenizer|index`."""
    from pretraining.data.arguments import data_parser

    args = data_parser().parse_args(argv)
    from pretraining.data import commands
    from pretraining.data.documents import CorpusError

    try:
        getattr(commands, args.command)(args)
    except (CorpusError, PretrainingError, OSError, ValueError) as error:
        sys.exit(f"pretrain-data {args.command}: error: {error}")


def info(argv: Sequence[str] | None = None) -> None:
    """`pretrain-info CKPT`: what produced a checkpoint."""
    parser = argparse.ArgumentParser(prog="pretrain-info", description="What produced a checkpoint.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint file or sharded directory (or last.ckpt)")
    parser.add_argument("--config", action="store_true", help="also print the full resolved config")
    parser.add_argument("--json", action="store_true", help="print the lineage and ancestry as JSON")
    args = parser.parse_args(argv)
    from pretraining.info import print_info

    try:
        print_info(args.checkpoint, args.config, args.json)
    except (FileNotFoundError, PretrainingError) as error:
        sys.exit(f"pretrain-info: {error}")
