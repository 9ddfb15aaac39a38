"""Checkpoints written in the background (`callbacks.checkpoint.background`): training goes on during the
write, the file holds the state of its step, one write at a time, and a kill during the write leaves the
previous checkpoint the newest good one."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer

import pretraining.files
from conftest import tiny_run
from pretraining.checkpoint import newest_verified, saved_checkpoints
from pretraining.checkpoint.background import BackgroundWriter, host_copy
from pretraining.checkpoint.sharded import load_sharded
from pretraining.config import CONFIG_DIR
from pretraining.train import train
from test_checkpoint import pretrain_process
from test_resume import pretrain, run_dir
from test_sharded_checkpoint import SHARDED

# Saves at steps 2, 4 and 6; no validation between them (it would wait for the write, see HeldWriter).
EVERY_TWO = ["trainer.max_steps=6", "callbacks.checkpoint.every_n_steps=2", "trainer.val_check_interval=1000"]


def run(root: Path, data: Path, *overrides: str) -> Path:
    """Train a tiny run into `root`; its checkpoint directory."""
    base = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={data}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        train(compose("train", overrides=[*base, *tiny_run(), *EVERY_TWO, *overrides]))
    return root / "checkpoints"


def test_a_host_copy_does_not_change_with_the_state_it_copied() -> None:
    weights = torch.ones(3)
    state = {"state_dict": {"w": weights}, "optimizer_states": [{"state": {0: {"exp_avg": weights * 2}}}], "step": [5]}
    copied = host_copy(state)
    weights.add_(1)
    state["optimizer_states"][0]["state"][0]["exp_avg"].zero_()
    state["step"].append(6)
    assert copied == {
        "state_dict": {"w": copied["state_dict"]["w"]},
        "optimizer_states": copied["optimizer_states"],
        "step": [5],
    }
    assert copied["state_dict"]["w"].tolist() == [1.0] * 3
    assert copied["optimizer_states"][0]["state"][0]["exp_avg"].tolist() == [2.0] * 3


class HeldWriter(Callback):
    """Holds each background write (but the last step's) until training has gone past the step it
    saves, and records how many writes ran at once: a write the step waited for never lets it pass."""

    overtaken: ClassVar[list[bool]] = []
    most_at_once = 0

    def __init__(self) -> None:
        self.running = 0
        self.lock = threading.Lock()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        writer = trainer.checkpoint_callback.writer  # type: ignore[union-attr]  # StepCheckpoint's
        submit = writer.submit

        def held_submit(path: Path, write: Callable[[], None]) -> None:
            step = trainer.global_step  # the step being saved

            def held() -> None:
                with self.lock:
                    self.running += 1
                    HeldWriter.most_at_once = max(HeldWriter.most_at_once, self.running)
                if step < trainer.max_steps:
                    deadline = time.monotonic() + 20
                    while trainer.global_step <= step and time.monotonic() < deadline:
                        time.sleep(0.005)
                    HeldWriter.overtaken.append(trainer.global_step > step)
                write()
                with self.lock:
                    self.running -= 1

            submit(path, held)

        writer.submit = held_submit  # type: ignore[method-assign]


def test_training_goes_on_while_a_checkpoint_is_written_and_the_file_holds_its_steps_state(
    tmp_path: Path, shard_dir: Path
) -> None:
    HeldWriter.overtaken, HeldWriter.most_at_once = [], 0
    background = run(tmp_path / "background", shard_dir, "+callbacks.held._target_=test_async_checkpoint.HeldWriter")
    assert HeldWriter.overtaken == [True, True] and HeldWriter.most_at_once == 1
    synchronous = run(tmp_path / "synchronous", shard_dir, "callbacks.checkpoint.background=false")
    assert [step for step, _ in saved_checkpoints(background)] == [6, 4]  # pruned to keep_last=2 once written
    assert (background / "last.ckpt").resolve().name == "step-000006.ckpt"
    for step in (4, 6):
        written, expected = (
            torch.load(d / f"step-{step:06d}.ckpt", weights_only=True) for d in (background, synchronous)
        )
        assert written["global_step"] == expected["global_step"] == step
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops"):
            torch.testing.assert_close(written[key], expected[key], rtol=0, atol=0)
        assert written["ShardDataModule"] == expected["ShardDataModule"]  # the data position


class KillDuringWrite(Callback):
    """SIGKILL the whole process while the writer thread writes step 4's checkpoint: its file is written
    and fsynced under a temporary name, not yet checksummed nor renamed."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        checksum = pretraining.files.sha256_of

        def killing(path: Path) -> str:
            if "step-000004" in path.name and threading.current_thread() is not threading.main_thread():
                os.kill(os.getpid(), signal.SIGKILL)
            return checksum(path)

        pretraining.files.sha256_of = killing  # type: ignore[assignment]


@pytest.mark.slow  # tests/test_checkpoint.py's kill during a save stays in the fast suite
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_the_newest(
    tmp_path: Path, shard_dir: Path
) -> None:
    overrides = [*tiny_run(), *EVERY_TWO, f"hydra.run.dir={tmp_path}", f"data.dir={shard_dir}"]
    killed = pretrain_process([*overrides, "+callbacks.kill._target_=test_async_checkpoint.KillDuringWrite"])
    checkpoints = tmp_path / "checkpoints"
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list(checkpoints.glob(".step-000004.ckpt.tmp-*"))  # the write was under way
    newest = newest_verified(checkpoints)
    assert newest is not None and newest[0].name == "step-000002.ckpt"
    assert pretrain_process(overrides).returncode == 0  # the same command continues from step 2
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [6, 4]
    assert not list(checkpoints.glob(".*tmp*"))  # pruning removed the leftover


def test_a_failed_write_is_reported_once_and_an_unfinished_one_stays_in_flight(tmp_path: Path) -> None:
    writer, release = BackgroundWriter(), threading.Event()
    writer.submit(tmp_path / "a.ckpt", lambda: release.wait(10))
    assert writer.finished(wait=False) is None and writer.in_flight == tmp_path / "a.ckpt"
    release.set()
    assert writer.finished(wait=True) == tmp_path / "a.ckpt" and writer.in_flight is None

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(tmp_path / "b.ckpt", fail)
    with pytest.raises(OSError, match="No space left"):
        writer.finished(wait=True)
    assert writer.in_flight is None and writer.finished(wait=True) is None
    writer.close()


@pytest.mark.slow
def test_a_background_sharded_save_holds_what_a_synchronous_one_holds(tmp_path: Path, small_shards: Path) -> None:
    """FSDP2 on two processes: DCP's async_save writes the shards while training goes on."""
    overrides = [*tiny_run(), *SHARDED, *EVERY_TWO, f"data.dir={small_shards}"]
    assert pretrain(tmp_path, "background", overrides) == 0
    assert pretrain(tmp_path, "synchronous", [*overrides, "callbacks.checkpoint.background=false"]) == 0
    for step in (4, 6):
        written, expected = (
            load_sharded(run_dir(tmp_path, run) / "checkpoints" / f"step-{step:06d}.ckpt")
            for run in ("background", "synchronous")
        )
        assert written["global_step"] == expected["global_step"] == step
        torch.testing.assert_close(written["state_dict"], expected["state_dict"], rtol=0, atol=0)
    newest = newest_verified(run_dir(tmp_path, "background") / "checkpoints")
    assert newest is not None and newest[0].name == "step-000006.ckpt" and newest[0].is_dir()
