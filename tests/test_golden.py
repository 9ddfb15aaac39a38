"""A golden run per objective: the training loss at every step of a short fixed run, and the validation
metrics at its end, are those recorded, within a relative tolerance of `TOLERANCE` on any machine.

Floating point differs across CPUs and torch builds in the last bits, which a few steps barely grow; a
change that moves the data order, the masking, the initialisation, the loss or the update moves these
numbers by far more. The data is made here from a seeded generator, so it is the same on every Python, and
the runs use one thread, so that no reduction order depends on the machine's cores. After a deliberate change
of behaviour, record them again with `GOLDEN_RECORD=1 pytest tests/test_golden.py` and say why in the commit.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pretraining.data.commands import train_texts
from pretraining.data.corpus import Document
from pretraining.data.manifest import PAIR_FIELDS, Manifest
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import train_bpe
from pretraining.train import train

GOLDEN = Path(__file__).with_name("golden.json")
TOLERANCE = 1e-4  # relative: a refactoring keeps every number within it
# The default experiment at its own model size, and every objective at the tests' tiny size.
RUNS = {
    "clm_tiny": ("clm_tiny", False, ["logger=csv", "trainer.max_steps=4", "model.warmup_steps=2"]),
    "clm_tiny-tiny": ("clm_tiny", True, []),
    "mlm_tiny-tiny": ("mlm_tiny", True, []),
    "contrastive_tiny-tiny": ("contrastive_tiny", True, []),
}
SHORT = [
    "trainer.val_check_interval=4",
    "callbacks.checkpoint.every_n_steps=4",
    "data.val_size=8",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]


def words(rng: random.Random, count: int) -> str:
    vocabulary = [f"w{index}" for index in range(300)]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


@pytest.fixture(scope="module")
def golden_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Text shards and pair shards (with their BPE) of seeded pseudo-words: the same bytes on any Python."""
    rng = random.Random(17)
    root = tmp_path_factory.mktemp("golden")
    texts = [Document(f"doc{i}", {"txt": words(rng, rng.randint(50, 400))}) for i in range(120)]
    build_shards(texts, root / "text", ["golden"], BuildSettings(0.2, max_shard_bytes=20_000), show_progress=False)
    pairs = []
    for i in range(160):
        query = words(rng, 6)
        pairs.append(Document(f"pair{i}", dict(zip(PAIR_FIELDS, [query, f"{query} {words(rng, 30)}"], strict=True))))
    settings = BuildSettings(0.25, max_shard_samples=30)
    build_shards(pairs, root / "pairs", ["golden"], settings, show_progress=False, fields=PAIR_FIELDS)
    train_bpe(train_texts(Manifest.load(root / "pairs")), vocab_size=320, out_path=root / "pairs" / "tokenizer.json")
    return {"text": root / "text", "pairs": root / "pairs"}


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def curve(run_dir: Path, metrics: dict[str, float]) -> dict[str, float]:
    """`train/loss` at every step (from the run's CSV log) and the final `val/` metrics."""
    with (run_dir / "csv" / "metrics.csv").open() as file:
        losses = {
            f"train/loss@{row['step']}": float(row["train/loss"]) for row in csv.DictReader(file) if row["train/loss"]
        }
    return losses | {name: value for name, value in metrics.items() if name.startswith("val/")}


@pytest.mark.parametrize("name", RUNS)
def test_the_loss_curve_of_a_short_run_is_the_recorded_one(
    name: str, compose_train, tmp_path: Path, golden_data: dict[str, Path], one_thread: None
) -> None:
    experiment, tiny, overrides = RUNS[name]
    data = golden_data["pairs" if experiment == "contrastive_tiny" else "text"]
    metrics = train(compose_train(*SHORT, *overrides, f"data.dir={data}", tiny=tiny, experiment=experiment))
    actual = curve(tmp_path, metrics)
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    if os.environ.get("GOLDEN_RECORD"):
        GOLDEN.write_text(json.dumps(recorded | {name: actual}, indent=1, sort_keys=True) + "\n")
        return
    assert actual.keys() == recorded[name].keys(), f"{name}: other steps or metrics than recorded"
    for key, value in recorded[name].items():
        assert actual[key] == pytest.approx(value, rel=TOLERANCE), f"{name}: {key} is {actual[key]}, recorded {value}"
