"""Checkpoint integrity (atomic writes, sidecars, fallback) and the data position the DataModule saves."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pretraining.data.stream as stream_module
from pretraining.checkpoint import (
    AtomicCheckpointIO,
    CheckpointError,
    StepCheckpoint,
    newest_verified,
    on_cpu,
    saved_checkpoints,
    sidecar_path,
    verify,
)
from pretraining.data.datamodule import BlockDataModule
from pretraining.data.stream import Cursor
from pretraining.data.tokenizer import ByteTokenizer


def save(directory: Path, step: int) -> Path:
    path = directory / f"step-{step:06d}.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((64,), step)}}, path)
    return path


def test_save_writes_a_sidecar_that_verifies(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    record = verify(path)
    assert record["step"] == 3 and record["bytes"] == path.stat().st_size and record["parameters"] == {"w": [64]}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, sidecar_path(path).name]  # no temporaries
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], torch.full((64,), 3))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    newest.write_bytes(newest.read_bytes()[:-100])
    with pytest.warns(UserWarning, match=r"step-000002.ckpt has \d+ bytes, its sidecar says \d+: it is truncated"):
        path, record = newest_verified(tmp_path)
    assert path.name == "step-000001.ckpt" and record["step"] == 1


def test_newest_is_the_step_the_sidecar_records_not_the_file_name(tmp_path: Path) -> None:
    save(tmp_path, 999_999)
    save(tmp_path, 1_000_000)  # "step-1000000.ckpt" sorts before "step-999999.ckpt" by name
    path, record = newest_verified(tmp_path)
    assert record["step"] == 1_000_000 and path.name == "step-1000000.ckpt"
    assert [step for step, _ in saved_checkpoints(tmp_path)] == [1_000_000, 999_999]


def test_a_flipped_byte_fails_the_checksum(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match the SHA-256 in its sidecar: it is corrupt"):
        verify(path)
    with pytest.raises(CheckpointError, match="the SHA-256"):
        AtomicCheckpointIO().load_checkpoint(path)


def test_a_checkpoint_without_its_sidecar_is_skipped_and_never_deleted(tmp_path: Path) -> None:
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    sidecar_path(path).unlink()
    with pytest.raises(CheckpointError, match=r"has no sidecar step-000002\.ckpt\.json, which is written last"):
        verify(path)
    with pytest.warns(UserWarning, match="no sidecar"):
        assert newest_verified(tmp_path)[0].name == "step-000001.ckpt"
    StepCheckpoint(str(tmp_path), keep_last=2).prune(keep=tmp_path / "step-000001.ckpt")
    assert path.is_file()  # perhaps copied without its sidecar: not ours to delete


def test_a_directory_where_no_checkpoint_verifies_is_refused_not_started_over(tmp_path: Path) -> None:
    for step in (1, 2):
        sidecar_path(save(tmp_path, step)).unlink()
    with (
        pytest.warns(UserWarning),
        pytest.raises(CheckpointError, match=r"(?s)no checkpoint in .* verifies.*resume=never"),
    ):
        newest_verified(tmp_path)
    assert newest_verified(tmp_path / "absent") is None


def test_loading_maps_to_the_cpu_by_default(tmp_path: Path, monkeypatch) -> None:
    path = save(tmp_path, 1)
    seen = {}
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.update(k) or original(*a, **k))
    AtomicCheckpointIO().load_checkpoint(path)
    assert seen["map_location"] is on_cpu and seen["weights_only"] is True


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_and_no_unverifiable_one(tmp_path: Path) -> None:
    # The process dies by SIGKILL in the middle of writing step 2 (while pickling it).
    code = textwrap.dedent(f"""
        import os, signal, torch
        from pathlib import Path
        from pretraining.checkpoint import AtomicCheckpointIO

        class DieWhilePickled:
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        io, directory = AtomicCheckpointIO(), Path({str(tmp_path)!r})
        small = {{"global_step": 1, "state_dict": {{"w": torch.ones(1000)}}}}
        io.save_checkpoint(small, directory / "step-000001.ckpt")
        big = {{"global_step": 2, "state_dict": {{"w": torch.ones(100000)}}, "z": DieWhilePickled()}}
        io.save_checkpoint(big, directory / "step-000002.ckpt")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == -9, result.stderr
    assert not (tmp_path / "step-000002.ckpt").exists()  # only a temporary, never the final name
    assert list(tmp_path.glob(".step-000002.ckpt.tmp-*"))
    assert all(sidecar_path(path).is_file() for path in tmp_path.glob("*.ckpt"))
    path, _ = newest_verified(tmp_path)
    assert path.name == "step-000001.ckpt"
    assert [step for step, _ in saved_checkpoints(tmp_path)] == [1]


# --- the data position ------------------------------------------------------------------------------


def datamodule(directory: Path, workers: int) -> BlockDataModule:
    # 64-byte blocks: an epoch of the small shards is about 17 batches.
    return BlockDataModule(str(directory), ByteTokenizer(), block_size=64, global_batch_size=4, num_workers=workers)


def consume(module: BlockDataModule, batches: int) -> list[list[int]]:
    """The sample ids of the next `batches` training batches, each passed through the module's hook
    as the training loop does."""
    loader = iter(module.train_dataloader())
    taken = []
    for _ in range(batches):
        batch = module.on_before_batch_transfer(next(loader), 0)
        taken.append(batch["sample_id"].tolist())
    return taken


@pytest.mark.parametrize("workers", [0, 2])
def test_restoring_after_any_number_of_batches_continues_the_same_stream(small_shards: Path, workers: int) -> None:
    """Every restart point (first batch, inside shards, at shard and epoch boundaries) continues exactly."""
    total = 26  # more than an epoch
    reference = consume(datamodule(small_shards, workers), total)
    for consumed in range(total):
        first = datamodule(small_shards, workers)
        consume(first, consumed)
        restored = datamodule(small_shards, workers)
        restored.load_state_dict(first.state_dict())
        assert consume(restored, total - consumed) == reference[consumed:], f"restart after {consumed} batches"


def test_an_off_by_one_position_gives_other_batches(small_shards: Path) -> None:
    """The negative controls: cursors one block back, or a step count one off (the sub-streams' turns
    are then swapped between the workers), change the batches."""
    reference = consume(datamodule(small_shards, 2), 12)
    first = datamodule(small_shards, 2)
    consume(first, 7)
    state = first.state_dict()
    assert state["steps"] == 7 and len(state["cursors"]) == 2 and all(block > 0 for _, _, block in state["cursors"])
    shifted = {**state, "cursors": [[sub, shard, block - 1] for sub, shard, block in state["cursors"]]}
    rotated = {**state, "steps": 8}
    for name, wrong in (("shifted", shifted), ("rotated", rotated)):
        restored = datamodule(small_shards, 2)
        restored.load_state_dict(wrong)
        assert consume(restored, 5) != reference[7:], name


def test_restoring_reads_at_most_the_current_shard_again(small_shards: Path, monkeypatch) -> None:
    """Skip-ahead cost does not grow with the position: finished shards are skipped without reading."""
    first = datamodule(small_shards, 0)
    consume(first, 60)  # several epochs in
    opened: list[str] = []
    read_shard = stream_module.read_shard
    monkeypatch.setattr(stream_module, "read_shard", lambda url: opened.append(url) or read_shard(url))
    restored = datamodule(small_shards, 0)
    restored.load_state_dict(first.state_dict())
    consume(restored, 1)
    assert 1 <= len(opened) <= 2  # the shard in progress, and the next if the batch runs past its end


def test_another_worker_count_resumes_approximately_where_allowed(small_shards: Path) -> None:
    first = datamodule(small_shards, 2)
    consume(first, 30)
    state = first.state_dict()
    done = sum(shard for _, shard, _ in state["cursors"])
    restored = datamodule(small_shards, 0)  # one sub-stream instead of two
    with pytest.warns(UserWarning, match=r"data topology changed .* resumes approximately"):
        restored.load_state_dict(state)
    assert restored.cursors == {0: Cursor(done)} and restored.batches_consumed == 30
    assert len(consume(restored, 3)) == 3
