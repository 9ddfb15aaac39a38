"""A run's lineage is append-only: the mixture phases of steps trained before a resume are kept when a source is
removed, `pretrain-info` prints them (and the data's origin, never an empty "from a mixture of"), and it prints
the validation metrics a checkpoint's sidecar records."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ComposeTrain
from pretraining.checkpoint import verify
from pretraining.cli import info as info_main
from pretraining.stored import load_checkpoint
from pretraining.train import train


def sources(**dirs: Path) -> list[str]:
    """data.dir=null and data.sources of these directories, weighted 0.7 and 0.3 in that order."""
    entries = ",".join(
        f"{name}:{{dir:'{path}',weight:{weight}}}"
        for (name, path), weight in zip(dirs.items(), (0.7, 0.3), strict=False)
    )
    return ["data.dir=null", f"data.sources={{{entries}}}"]


def test_a_source_removed_on_resume_keeps_the_earlier_phases_in_the_lineage_and_info(
    compose_train: ComposeTrain, tmp_path: Path, shard_dir: Path, small_shards: Path, capsys: pytest.CaptureFixture
) -> None:
    train(compose_train(*sources(code=shard_dir, docs=small_shards), "trainer.max_steps=6"))
    train(compose_train(*sources(code=shard_dir), "trainer.max_steps=12", "resume_allow=[data,mixture]"))
    last = tmp_path / "checkpoints" / "step-000012.ckpt"
    lineage = load_checkpoint(last)["lineage"]
    assert lineage["mixture_phases"] == [
        {"step": 0, "weights": {"code": 0.7, "docs": 0.3}},
        {"step": 6, "weights": {"code": 0.7}},
    ]
    capsys.readouterr()  # the training runs' output
    info_main([str(last)])
    printed = capsys.readouterr().out
    assert re.search(rf"\ndata +version {lineage['data_version']} from {shard_dir}\n", printed)
    assert re.search(r"\n  phase +from step 0: code 0.7, docs 0.3\n  phase +from step 6: code 0.7\n", printed)
    assert "a mixture of\n" not in printed


def test_info_prints_the_validation_its_sidecar_records(
    compose_train: ComposeTrain, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    train(compose_train("trainer.max_steps=6"))
    checkpoint = tmp_path / "checkpoints" / "step-000006.ckpt"
    validation = verify(checkpoint)["validation"]
    capsys.readouterr()
    info_main([str(checkpoint)])
    printed = capsys.readouterr().out
    (row,) = [line for line in printed.splitlines() if line.startswith("validation ")]
    assert f"val/bpb {validation['val/bpb']:.4g}" in row and f"val/loss {validation['val/loss']:.4g}" in row
    assert "train/loss" in validation and "train/loss" not in row  # what else the sidecar keeps is not a metric
