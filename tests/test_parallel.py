"""FSDP2 through `pretraining.plugins.fsdp.FSDP2Strategy` on two CPU processes (gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_run
from pretraining.callbacks.batch_log import batch_log_differences, read_batch_log

pytestmark = pytest.mark.distributed  # two processes (gloo)


def pretrain(log_dir: Path, run: str, overrides: list[str]) -> Path:
    """Run `pretrain` to the end; its run directory."""
    command = [sys.executable, "-m", "pretraining", *overrides, f"paths.log_dir={log_dir}", f"run_name={run}"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return log_dir / "train" / "runs" / run


@pytest.mark.slow  # two 2-process runs, ~90 s on 2 cores
def test_activation_checkpointing_trains_the_masked_lm_with_the_same_losses(tmp_path: Path, small_shards: Path) -> None:
    # The masked LM calls its backbone from training_step, not through forward: the FSDP root must
    # still gather the embeddings. Dropout on: the recomputation must replay the same masks.
    overrides = [
        *tiny_run("mlm_tiny"),
        "trainer=fsdp_cpu",
        f"data.dir={small_shards}",
        "model.backbone.dropout=0.1",
        "model.backbone.n_layer=2",
        "trainer.max_steps=4",
        "callbacks=[default,batch_log]",
        "validate_before_training=false",
    ]
    plain = pretrain(tmp_path, "plain", overrides)
    checkpointed = pretrain(tmp_path, "checkpointed", [*overrides, "trainer.strategy.activation_checkpointing=true"])
    losses = [record["loss"] for record in read_batch_log(plain / "batches" / "rank0.jsonl").values()]
    assert len(losses) == 4 and len(set(losses)) == 4  # it trained: every step a new loss
    assert not batch_log_differences(plain / "batches", checkpointed / "batches")
