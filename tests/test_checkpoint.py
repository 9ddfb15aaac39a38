"""Checkpoint integrity (atomic writes, sidecars, fallback) and the data position the DataModule saves."""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.trainer.states import TrainerFn

import pretraining.checkpoint.store as checkpoint_store
import pretraining.data.reader as reader_module
from conftest import packed_blocks, tiny_run
from pretraining.checkpoint import CheckpointError, newest_verified, prune, saved_checkpoints, sidecar_path, verify
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.stream import Cursor
from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import ConfigError, StorageError
from pretraining.files import sha256_of
from pretraining.plugins.checkpoint_io import AtomicCheckpointIO, on_cpu
from pretraining.train import train


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


def test_a_checkpoint_without_its_sidecar_is_an_unfinished_save_skipped_and_never_deleted(tmp_path: Path) -> None:
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    sidecar_path(path).unlink()
    with pytest.raises(CheckpointError, match=r"has no sidecar step-000002\.ckpt\.json, which is written last"):
        verify(path)
    with pytest.warns(UserWarning, match=r"step-000002\.ckpt has no sidecar .* a save that did not finish"):
        assert newest_verified(tmp_path)[0].name == "step-000001.ckpt"
    prune(tmp_path, keep_last=2, keep_every=None, keep=tmp_path / "step-000001.ckpt")
    assert path.is_file()  # perhaps copied without its sidecar: not ours to delete
    sidecar_path(tmp_path / "step-000001.ckpt").unlink()  # two: copied without them, not a kill (one save at a time)
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match=r"(?s)no checkpoint in .* verifies"):
        newest_verified(tmp_path)
    sidecar_path(save(tmp_path / "first", 1)).unlink()  # a kill during a run's first save: it starts again
    with pytest.warns(UserWarning, match="a save that did not finish"):
        assert newest_verified(tmp_path / "first") is None


def test_a_directory_where_no_checkpoint_verifies_is_refused_not_started_over(tmp_path: Path) -> None:
    for step in (1, 2):
        path = save(tmp_path, step)
        path.write_bytes(path.read_bytes()[:-1] + b"!")  # complete saves, corrupted since
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
        from pretraining.plugins.checkpoint_io import AtomicCheckpointIO

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


def datamodule(directory: Path, workers: int) -> ShardDataModule:
    # 64-byte blocks: an epoch of the small shards is about 17 batches.
    return ShardDataModule(
        str(directory), ByteTokenizer(), format=packed_blocks(64), global_batch_size=4, streams=1, num_workers=workers
    )


def consume(module: ShardDataModule, batches: int) -> list[list[int]]:
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
    assert state["steps"] == 7 and len(state["cursors"]) == 2 and all(block > 0 for *_, block in state["cursors"])
    shifted = {**state, "cursors": [[name, sub, shard, block - 1] for name, sub, shard, block in state["cursors"]]}
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
    read_shard = reader_module.read_shard
    monkeypatch.setattr(reader_module, "read_shard", lambda url: opened.append(url) or read_shard(url))
    restored = datamodule(small_shards, 0)
    restored.load_state_dict(first.state_dict())
    consume(restored, 1)
    assert 1 <= len(opened) <= 2  # the shard in progress, and the next if the batch runs past its end


def test_another_worker_count_resumes_approximately_where_allowed(small_shards: Path) -> None:
    first = datamodule(small_shards, 2)
    consume(first, 30)
    state = first.state_dict()
    done = sum(shard for _, _, shard, _ in state["cursors"])
    restored = datamodule(small_shards, 0)  # one sub-stream instead of two
    with pytest.warns(UserWarning, match=r"data topology changed .* resumes approximately"):
        restored.load_state_dict(state)
    assert restored.position.cursors == {(0, 0): Cursor(done)} and restored.position.batches_consumed == 30
    assert len(consume(restored, 3)) == 3


# --- storage faults: a full disk, an unwritable directory -------------------------------------------------------


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes of any file fail with EFBIG, as a full disk fails them with ENOSPC: a
    real failure of the operating system's `write`, in this process only."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def directory_state(directory: Path) -> dict[str, str]:
    return {path.name: sha256_of(path) for path in directory.iterdir() if path.is_file() and not path.is_symlink()}


def test_a_failed_save_leaves_the_previous_checkpoint_of_the_same_step_and_no_temporaries(tmp_path: Path) -> None:
    path = save(tmp_path, 4)
    before = directory_state(tmp_path)
    with file_size_limit(300), pytest.raises(OSError) as failed:
        save(tmp_path, 4)  # the same step again (a preemption save, say), into a full disk
    assert failed.value.errno == errno.EFBIG
    assert directory_state(tmp_path) == before and verify(path)["step"] == 4


def test_a_checkpoint_whose_sidecar_cannot_be_written_is_removed(tmp_path: Path, monkeypatch) -> None:
    save(tmp_path, 4)
    before = directory_state(tmp_path)

    def full(path: Path, record: dict) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(sidecar_path(path)))

    monkeypatch.setattr(checkpoint_store, "write_sidecar", full)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 8)
    assert directory_state(tmp_path) == before  # step 8 is gone, not left without a sidecar


@pytest.mark.slow  # two runs; a failed save's cleanup is in the fast suite (above)
def test_a_full_disk_stops_the_run_naming_the_cause_and_the_intact_checkpoint(tmp_path: Path, shard_dir: Path) -> None:
    """A real `pretrain` process (its output goes to pipes, which no file size limit touches)."""
    overrides = [*tiny_run(), "trainer.max_steps=12", f"hydra.run.dir={tmp_path}", f"data.dir={shard_dir}"]
    stopped = pretrain_process([*overrides, "+callbacks.disk._target_=test_checkpoint.FillDiskAfterFirstSave"])
    checkpoints = tmp_path / "checkpoints"
    assert stopped.returncode == 1
    message = " ".join(stopped.stderr.split())  # as one line, however the traceback wraps it
    assert re.search(r"saving \S*step-000012\.ckpt failed: \[Errno 27\] File too large", message), message[-2000:]
    assert f"the newest complete checkpoint, {checkpoints / 'step-000006.ckpt'}, is intact" in message
    assert "Free space on that disk" in message and "run the same command to continue" in message
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [6] and verify(checkpoints / "step-000006.ckpt")
    assert (checkpoints / "step-000006.ckpt").stat().st_size > FillDiskAfterFirstSave.LIMIT  # the limit bites
    assert not list(checkpoints.glob(".*tmp*")) and not (checkpoints / "step-000012.ckpt").exists()
    assert pretrain_process(overrides).returncode == 0  # space again: the same command continues from step 6
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [12, 6]


def pretrain_process(overrides: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pretraining", *overrides]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


class FillDiskAfterFirstSave(Callback):
    """From the step after the first checkpoint on, no file can grow past `LIMIT` (see `file_size_limit`)."""

    LIMIT = 64 * 1024

    def __init__(self) -> None:
        self.limit = contextlib.ExitStack()

    def on_train_batch_start(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == 7:
            self.limit.enter_context(file_size_limit(self.LIMIT))

    def teardown(self, *args: object, **kwargs: object) -> None:
        self.limit.close()


def test_a_checkpoint_io_without_sidecars_is_refused_before_any_step(compose_train, tmp_path: Path) -> None:
    """Lightning's own writer (trainer.plugins without AtomicCheckpointIO) would save checkpoints that no run
    resumes from."""
    with pytest.raises(ConfigError, match=r"saves through TorchCheckpointIO, not AtomicCheckpointIO"):
        train(compose_train("trainer.plugins=[]"))
    assert not (tmp_path / "checkpoints").exists()


def test_an_unwritable_directory_stops_the_run_naming_it(compose_train, tmp_path: Path, monkeypatch) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    if os.geteuid() != 0:
        checkpoints.chmod(0o555)
    else:  # root writes anywhere: refuse as the kernel would refuse anyone else
        real_open = Path.open

        def refuse(self: Path, mode: str = "r", *args: object, **kwargs: object):
            if self.parent == checkpoints and "w" in mode:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real_open(self, mode, *args, **kwargs)

        monkeypatch.setattr(Path, "open", refuse)
    try:
        with pytest.raises(
            CheckpointError,
            match=r"step-000006\.ckpt failed: \[Errno 13\] Permission denied.*"
            r"no checkpoint was saved before.*make .*checkpoints writable",
        ):
            train(compose_train("trainer.max_steps=12"))
    finally:
        checkpoints.chmod(0o755)
    assert not list(checkpoints.iterdir())


class ReadOnlyAtValidation(Callback):
    """The checkpoint directory turns read-only as the validation of step `step` starts: that step's checkpoint,
    saved after its validation, cannot be written, nor anything after."""

    def __init__(self, step: int, directory: str = "checkpoints") -> None:
        self.step, self.directory = step, directory

    def on_validation_start(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step and trainer.state.fn == TrainerFn.FITTING:
            make_read_only(Path(trainer.default_root_dir) / self.directory)


def make_read_only(directory: Path) -> None:
    """As a remount would (root: the test mounted a file system there), or a permission change."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True)
    else:
        directory.chmod(0o555)


@contextmanager
def own_file_system(directory: Path) -> Iterator[None]:
    """For root, whom permissions do not stop: `directory` on a file system of its own, to remount read-only."""
    directory.mkdir()
    if os.geteuid() != 0:
        yield
        directory.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(directory)], capture_output=True).returncode:
        pytest.skip("root without the right to mount: no way to make a directory read-only for this process")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_a_run_directory_turned_read_only_outside_a_save_stops_the_run_with_one_line(
    compose_train, tmp_path: Path
) -> None:
    """A write that is no checkpoint's (the CSV logger's, at step 12's validation, after step 6 was saved) fails:
    the run stops with what was kept and how to go on."""
    read_only = [
        "+callbacks.read_only._target_=test_checkpoint.ReadOnlyAtValidation",
        "+callbacks.read_only.step=12",
        "+callbacks.read_only.directory=csv",
        "logger=csv",
    ]
    with own_file_system(tmp_path / "csv"):
        with pytest.raises(StorageError) as stopped:
            train(compose_train("trainer.max_steps=18", "callbacks.checkpoint.background=false", *read_only))
        message = str(stopped.value)
        assert re.search(r"the run stopped: \[Errno (30|13)\] (Read-only file system|Permission denied)", message)
        assert f"the newest complete checkpoint, {tmp_path / 'checkpoints' / 'step-000006.ckpt'}, is intact" in message
        assert "run the same command to continue" in message


def test_a_directory_turned_read_only_mid_run_stops_it_with_one_line_and_the_checkpoint_intact(
    compose_train, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    read_only = ["+callbacks.read_only._target_=test_checkpoint.ReadOnlyAtValidation", "+callbacks.read_only.step=12"]
    with own_file_system(checkpoints):
        with pytest.raises(CheckpointError) as stopped:
            train(compose_train("trainer.max_steps=18", "callbacks.checkpoint.background=false", *read_only))
        message = str(stopped.value)
        assert re.search(
            r"step-000012\.ckpt failed: \[Errno (30|13)\] (Read-only file system|Permission denied)", message
        )
        assert f"the newest complete checkpoint, {checkpoints / 'step-000006.ckpt'}, is intact" in message
        assert "run the same command to continue" in message
        assert verify(checkpoints / "step-000006.ckpt")["step"] == 6


class StopAtStep(Callback):
    """Stops training at `step`, as a time limit or a budget would between two validations."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def logged_rows(run: Path) -> list[tuple[str, str]]:
    """(step, train/loss) of each training row of the run's metrics.csv."""
    with (run / "csv" / "metrics.csv").open() as file:
        return [(row["step"], row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


def test_a_stop_between_validations_continues_with_each_row_at_its_step(compose_train, tmp_path: Path) -> None:
    """A stop off the validation schedule saves at the step boundary: Lightning, resuming it, counts the steps as a
    run never stopped does (saved inside the validation Lightning runs at a stop, it resumed one step behind)."""
    every_step = ["trainer.log_every_n_steps=1", "callbacks.checkpoint.background=false"]
    train(compose_train(*every_step, f"paths.output_dir={tmp_path / 'once'}"))
    stopped = [*every_step, f"paths.output_dir={tmp_path / 'twice'}"]
    train(compose_train(*stopped, "+callbacks.stop._target_=test_checkpoint.StopAtStep", "+callbacks.stop.step=4"))
    assert verify(tmp_path / "twice" / "checkpoints" / "step-000004.ckpt")["step"] == 4
    train(compose_train(*stopped))
    assert logged_rows(tmp_path / "twice") == logged_rows(tmp_path / "once")
