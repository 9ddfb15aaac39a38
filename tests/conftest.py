"""Shared fixtures: small real shards (a few standard-library packages), a BPE
tokenizer trained on them, and a composer for tiny, fast training configs. Each test under
tests/extras/<name>/ is marked `extras` and `<name>` (tests/README.md)."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pretraining.config import CONFIG_DIR
from pretraining.data.commands import train_texts
from pretraining.data.corpus import Document, read_text_files, stdlib_root
from pretraining.data.formats import PackedBlocks
from pretraining.data.manifest import PAIR_FIELDS, Manifest
from pretraining.data.negatives import mine_negatives
from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.pairs import docstring_pairs
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import Tokenizer, train_bpe
from pretraining.objectives.base import PretrainingObjective

EXTRAS = Path(__file__).parent / "extras"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests of each extra with its name and `extras`: `make test` runs the core's alone."""
    for item in items:
        path = Path(str(item.fspath))
        if path.is_relative_to(EXTRAS):
            item.add_marker("extras")
            item.add_marker(path.relative_to(EXTRAS).parts[0])


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One thread per test process, and for the `pretrain` processes tests start (they inherit it): the tiny
# models gain nothing from more, and on two cores pytest-xdist's two workers with a thread per core each
# oversubscribe them, where OpenMP's spinning threads make a test tens of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A model and run small enough for a few seconds of CPU, for any objective.
TINY = [
    "logger=csv",
    "model.backbone.d_model=32",
    "model.backbone.n_layer=1",
    "model.backbone.n_head=2",
    "model.backbone.max_seq_len=64",
    "model.warmup_steps=2",
    "data.global_batch_size=4",
    "data.streams=2",
    "data.num_workers=0",
    "data.val_size=8",
    "trainer.max_steps=12",
    "trainer.val_check_interval=6",
    "callbacks.checkpoint.every_n_steps=6",
    "callbacks.text_sample.max_new_tokens=16",
]
TINY_PAIRS = ["data.format.query_len=24", "data.format.passage_len=64", "data.val_batch_size=4"]


def tiny_run(experiment: str = "clm_tiny") -> list[str]:
    """Overrides for a tiny run of an experiment preset (its data, tokenizer and objective)."""
    return [f"experiment={experiment}", *TINY, *(TINY_PAIRS if experiment == "contrastive_tiny" else [])]


TINY_RUN = tiny_run()


# The test corpus: a few standard-library packages.
STDLIB_SAMPLE_PACKAGES = ("json", "email", "logging", "concurrent")
STDLIB_SAMPLE_SOURCES = [f"stdlib:{name}" for name in STDLIB_SAMPLE_PACKAGES]


def stdlib_sample_files() -> Iterator[Document]:
    return itertools.chain.from_iterable(read_text_files(stdlib_root() / name) for name in STDLIB_SAMPLE_PACKAGES)


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous, a daemon)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shards"
    settings = BuildSettings(validation_fraction=0.2, max_shard_bytes=100_000)
    build_shards(stdlib_sample_files(), out, STDLIB_SAMPLE_SOURCES, settings, show_progress=False)
    return out


@pytest.fixture(scope="session")
def bpe_path(shard_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(train_texts(Manifest.load(shard_dir)), vocab_size=320, out_path=path)
    return path


@pytest.fixture(scope="session")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of a few blocks each, so that a 24-step run crosses shards and epochs."""
    source = (stdlib_root() / "json" / "decoder.py").read_text()
    documents = [Document(f"doc{i}", {"txt": source[i * 300 : (i + 1) * 300]}) for i in range(24)]
    out = tmp_path_factory.mktemp("data") / "small"
    build_shards(documents, out, ["json/decoder.py"], BuildSettings(0.25, max_shard_bytes=800), show_progress=False)
    return out


def packed_blocks(block_size: int) -> Callable[[Tokenizer], PackedBlocks]:
    """`data.format` for packed blocks, as the config gives it to `ShardDataModule`."""
    return partial(PackedBlocks, block_size=block_size)


def tokenized_pairs(query_len: int, passage_len: int) -> Callable[[Tokenizer], TokenizedPairs]:
    """`data.format` for (query, passage) pairs, as the config gives it to `ShardDataModule`."""
    return partial(TokenizedPairs, query_len=query_len, passage_len=passage_len)


def fit_batch(model: PretrainingObjective, batch: dict[str, torch.Tensor], steps: int, lr: float) -> float:
    """Train `model` on one fixed batch with AdamW; the last training loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model.training_loss(batch)
        loss.backward()
        optimizer.step()
    return loss.item()


ComposeTrain = Callable[..., DictConfig]


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(docstring, code) pair shards of a few standard-library packages."""
    out = tmp_path_factory.mktemp("data") / "pairs"
    settings = BuildSettings(validation_fraction=0.25, max_shard_samples=100)
    pairs = docstring_pairs(stdlib_sample_files())
    build_shards(pairs, out, STDLIB_SAMPLE_SOURCES, settings, show_progress=False, fields=PAIR_FIELDS)
    train_bpe(
        train_texts(Manifest.load(out)), vocab_size=320, out_path=out / "tokenizer.json"
    )  # contrastive_tiny's tokenizer=bpe
    return out


@pytest.fixture(scope="session")
def negatives_dir(pair_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pair_dir`'s pairs with 3 BM25-mined hard negatives each (`pretrain-data negatives`)."""
    out = tmp_path_factory.mktemp("data") / "negatives"
    mine_negatives(str(pair_dir), str(out), 3)
    return out


@pytest.fixture
def compose_train(tmp_path: Path, shard_dir: Path, request: pytest.FixtureRequest) -> ComposeTrain:
    """Compose configs/train.yaml for a tiny run of `experiment` writing into tmp_path, on the
    test shards (text or pairs, whichever the data config reads)."""

    def compose_(*overrides: str, tiny: bool = True, experiment: str = "clm_tiny") -> DictConfig:
        base = [f"paths.output_dir={tmp_path}", f"paths.log_dir={tmp_path}/logs"]
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[*base, *(tiny_run(experiment) if tiny else []), *overrides])
        if any(override.startswith(("data.dir=", "data.sources")) for override in overrides):
            return cfg
        if cfg.data.get("sources"):  # a mixture's sources: the text shards, or the pair shards for a pair field
            for source in cfg.data.sources.values():
                pairs = set(source.get("fields", {}).values()) & set(PAIR_FIELDS)
                source.dir = str(request.getfixturevalue("pair_dir") if pairs else shard_dir)
        else:
            pairs = cfg.data.format._target_.endswith("TokenizedPairs")
            cfg.data.dir = str(request.getfixturevalue("pair_dir") if pairs else shard_dir)
        return cfg

    return compose_
