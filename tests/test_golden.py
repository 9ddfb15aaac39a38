"""A golden run per objective: the weights after a short fixed run are bitwise those recorded.

A refactoring that changes no behaviour leaves every hash as it is; a change that moves one bit of
the data order, the masking, the initialisation or the update shows here. The data is made here from
a seeded generator, so it is the same on every Python; the hashes hold for the torch build and
machine recorded beside them (floating point differs across them): elsewhere the test is skipped,
saying so. After a deliberate change of behaviour, record them again with
`GOLDEN_RECORD=1 pytest tests/test_golden.py` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
from pathlib import Path

import pytest
import torch

from pretraining.data.commands import train_texts
from pretraining.data.corpus import PAIR_FIELDS, Document
from pretraining.data.manifest import Manifest
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import train_bpe
from pretraining.train import train

GOLDEN = Path(__file__).with_name("golden_weights.json")
# The default experiment at its own model size, and every objective at the tests' tiny size.
RUNS = {
    "clm_tiny": ("clm_tiny", False, ["logger=csv", "~callbacks.probe", "trainer.max_steps=4", "model.warmup_steps=2"]),
    "clm_tiny-tiny": ("clm_tiny", True, []),
    "mlm_tiny-tiny": ("mlm_tiny", True, []),
    "contrastive_tiny-tiny": ("contrastive_tiny", True, []),
}
SHORT = ["trainer.val_check_interval=4", "callbacks.checkpoint.every_n_steps=4", "data.val_size=8"]


def platform_key() -> dict[str, str]:
    return {"torch": torch.__version__, "machine": platform.machine()}


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


def weights_sha256(checkpoint: Path) -> str:
    """A hash of every weight's name, dtype, shape and bytes, in name order."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@pytest.mark.parametrize("name", RUNS)
def test_weights_after_a_short_run_are_the_recorded_ones(
    name: str, compose_train, tmp_path: Path, golden_data: dict[str, Path]
) -> None:
    experiment, tiny, overrides = RUNS[name]
    data = golden_data["pairs" if experiment == "contrastive_tiny" else "text"]
    train(compose_train(*SHORT, *overrides, f"data.dir={data}", tiny=tiny, experiment=experiment))
    actual = weights_sha256(tmp_path / "checkpoints" / "last.ckpt")
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {"platform": platform_key(), "weights": {}}
    if os.environ.get("GOLDEN_RECORD"):
        recorded["platform"] = platform_key()
        recorded["weights"][name] = actual
        GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    if recorded["platform"] != platform_key():
        pytest.skip(f"hashes recorded on {recorded['platform']}, this is {platform_key()}: record them here first")
    assert actual == recorded["weights"][name], f"{name}: the weights differ from the recorded run"
