"""Sharded checkpoints (FSDP2 with save_distributed_checkpoint=true): a directory of every rank's
shards, published atomically with a sidecar listing each file; verified, resumed exactly, and
evaluated on one process."""

from __future__ import annotations

import csv
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir

from conftest import tiny_run
from pretraining.checkpoint import CheckpointError, newest_verified, prune, saved_checkpoints, sidecar_path, verify
from pretraining.checkpoint.lineage import read_lineage
from pretraining.checkpoint.sharded import load_sharded, publish_sharded
from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError, MissingFileError
from pretraining.evaluate import evaluate
from pretraining.files import sha256_of, temporary_path
from pretraining.launch import own_process_group
from pretraining.resume import checkpoint_to_resume
from pretraining.stored import load_checkpoint
from pretraining.train import train
from test_resume import RESUMABLE, kill_twice_and_compare, pretrain, run_dir

TESTS = Path(__file__).parent
SHARDED = ["trainer=fsdp_cpu", "trainer.strategy.save_distributed_checkpoint=true"]


def save_sharded(directory: Path, step: int) -> Path:
    """A sharded checkpoint as rank zero publishes it, its shards written here by one process: a
    weight, its optimizer state, and meta.pt."""
    path = directory / f"step-{step:06d}.ckpt"
    temporary = temporary_path(path)
    state = {"state_dict": {"w": torch.full((64,), float(step))}, "optimizer_0": {"exp_avg": {"w": torch.ones(64)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(state, checkpoint_id=temporary, no_dist=True)
    torch.save({"global_step": step, "lineage": {"step": step}}, temporary / "meta.pt")
    publish_sharded(temporary, path)
    return path


def test_a_sharded_checkpoint_is_a_directory_whose_sidecar_lists_every_file(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 3)
    record = verify(path)
    assert record["step"] == 3 and record["parameters"] == {"w": [64]}  # the model's, not the optimizer's
    files = sorted(p.name for p in path.iterdir())
    assert sorted(record["files"]) == files and {"meta.pt", ".metadata", "__0_0.distcp"} <= set(files)
    assert record["bytes"] == sum((path / name).stat().st_size for name in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, sidecar_path(path).name]  # no temporaries
    assert saved_checkpoints(tmp_path) == [(3, path)]
    loaded = load_sharded(path)
    assert loaded["global_step"] == 3 and loaded["state_dict"].keys() == {"w"}
    assert torch.equal(loaded["state_dict"]["w"], torch.full((64,), 3.0))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-10])


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (truncate, r"__0_0\.distcp has \d+ bytes, its sidecar says \d+: it is truncated"),
        (flip_a_byte, r"__0_0\.distcp does not match the SHA-256 in its sidecar: it is corrupt"),
        (Path.unlink, r"__0_0\.distcp is missing: the checkpoint is incomplete"),
    ],
    ids=["truncated", "flipped", "missing"],
)
def test_a_damaged_shard_fails_verification_naming_it_and_resume_falls_back(tmp_path: Path, damage, message) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    previous = save_sharded(checkpoints, 4)
    newest = save_sharded(checkpoints, 8)
    verify(newest)  # verified once: a later change to its bytes must still be caught
    damage(newest / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=message):
        verify(newest)
    with pytest.warns(UserWarning, match=message):
        path, record = checkpoint_to_resume("auto", None, checkpoints)
    assert path == previous and record["step"] == 4


def test_a_file_written_into_a_checkpoint_after_its_save_fails_verification(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    (path / "__2_0.distcp").write_bytes(b"from another run")
    with pytest.raises(CheckpointError, match=r"__2_0\.distcp is not listed in the sidecar step-000001\.ckpt\.json"):
        verify(path)


@pytest.mark.parametrize(
    ("kill_in", "warning"),
    [
        ("sharded.sha256_of", None),
        pytest.param("store.write_sidecar", r"step-000002\.ckpt has no sidecar", marks=pytest.mark.slow),
    ],
    ids=["before_the_rename", "before_the_sidecar"],
)
def test_a_kill_during_a_sharded_save_leaves_the_previous_checkpoint_newest(tmp_path: Path, kill_in, warning) -> None:
    # Rank zero dies by SIGKILL while publishing step 2: checksumming its files, or writing its sidecar.
    code = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        import pretraining.checkpoint.sharded, pretraining.checkpoint.store
        from test_sharded_checkpoint import save_sharded

        save_sharded(Path({str(tmp_path)!r}), 1)
        module, name = {kill_in!r}.split(".")
        setattr(getattr(pretraining.checkpoint, module), name, lambda *args: os.kill(os.getpid(), signal.SIGKILL))
        save_sharded(Path({str(tmp_path)!r}), 2)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == -9, result.stderr
    unfinished, temporaries = tmp_path / "step-000002.ckpt", list(tmp_path.glob(".step-000002.ckpt.tmp-*"))
    if warning is None:  # nothing half-written under the final name, only the temporary directory
        assert not unfinished.exists() and len(temporaries) == 1 and temporaries[0].is_dir()
    else:  # renamed complete, but a checkpoint counts only once its sidecar is there
        assert unfinished.is_dir() and not sidecar_path(unfinished).exists() and not temporaries
    with pytest.warns(UserWarning, match=warning) if warning else warnings.catch_warnings():
        path, _ = newest_verified(tmp_path)
    assert path.name == "step-000001.ckpt" and [step for step, _ in saved_checkpoints(tmp_path)] == [1]
    assert all(temporary.exists() for temporary in temporaries)  # resuming leaves them: only the run's save cleans
    prune(tmp_path, keep_last=2, keep_every=None, keep=path)
    assert not list(tmp_path.glob(".*.tmp-*"))
    assert verify(save_sharded(tmp_path, 2))["step"] == 2  # saving the step again replaces what was left


def test_the_shard_index_cannot_run_code(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    sidecar_path(path).unlink()  # a checkpoint copied without its sidecar is still evaluated, so must be safe
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read: it refers to \w+\.mkdir, .* could run code"):
        load_checkpoint(path)
    assert not marker.exists()


def no_complete_sharded(tmp_path: Path) -> list[tuple[Path, str]]:
    """Directories given as sharded checkpoints: empty, one file short, and with a pipe or folder for a file."""
    empty, short, piped, foldered = (tmp_path / name for name in ("empty", "short", "piped", "foldered"))
    empty.mkdir()
    for path in (short, piped, foldered):
        save_sharded(tmp_path, 1).rename(path)
    (short / ".metadata").unlink()
    (piped / "meta.pt").unlink()
    os.mkfifo(piped / "meta.pt")  # would block its reader forever
    (foldered / "meta.pt").unlink()
    (foldered / "meta.pt").mkdir()
    return [
        (empty, rf"{empty} is not a complete sharded checkpoint: it has no \.metadata and no meta\.pt"),
        (short, rf"{short} is not a complete sharded checkpoint: it has no \.metadata \("),
        (piped, rf"the sharded checkpoint's file {piped}/meta\.pt is a named pipe, not a file"),
        (foldered, rf"the sharded checkpoint's file {foldered}/meta\.pt is a directory, not a file"),
    ]


def test_an_incomplete_sharded_checkpoint_or_one_holding_no_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    for path, message in no_complete_sharded(tmp_path):
        for read in (load_checkpoint, load_sharded, verify, read_lineage):  # read_lineage: pretrain-info's
            with pytest.raises((CheckpointError, MissingFileError), match=message):
                read(path)


@pytest.mark.slow  # a pretrain-eval process each, ~10 s on two loaded cores
def test_pretrain_eval_refuses_an_incomplete_sharded_checkpoint_without_a_traceback(tmp_path: Path) -> None:
    for path, message in no_complete_sharded(tmp_path)[:2]:
        program = str(Path(sys.executable).parent / "pretrain-eval")  # the console script
        command = [program, f"ckpt_path={path}", f"paths.log_dir={tmp_path}/logs"]
        run = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and re.search(message, run.stderr), run.stderr
        assert "Traceback" not in run.stderr, run.stderr  # Hydra's compact error: the message alone


def test_a_sharded_checkpoint_is_refused_before_any_work_without_fsdp2(compose_train, tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    with pytest.raises(ConfigError, match=r"is a sharded checkpoint .* only FSDP2 can resume: pass trainer=fsdp_cpu"):
        train(compose_train(f"ckpt_path={path}", f"paths.output_dir={tmp_path / 'run'}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- two processes -----------------------------------------------------------------------------------------


def last_validation(run: Path) -> dict[str, float]:
    with (run / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get("val/loss")]
    return {key: float(value) for key, value in rows[-1].items() if key.startswith("val/")}


@pytest.mark.distributed
def test_one_process_evaluates_a_two_process_sharded_checkpoint(tmp_path: Path, small_shards: Path) -> None:
    assert pretrain(tmp_path, "fsdp", [*tiny_run("clm_tiny"), *SHARDED, f"data.dir={small_shards}"]) == 0
    last = run_dir(tmp_path, "fsdp") / "checkpoints" / "last.ckpt"
    assert last.resolve().is_dir() and verify(last)["step"] == 12
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=[f"ckpt_path={last}", f"paths.output_dir={tmp_path}", "prompt=''"])
    result = evaluate(cfg)
    expected = last_validation(run_dir(tmp_path, "fsdp"))
    assert result["step"] == 12 and set(expected) == {"val/loss", "val/ppl", "val/bpb", "val/nonfinite_batches"}
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_sharded_run_killed_twice_resumes_exactly(tmp_path: Path, small_shards: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, *SHARDED, f"data.dir={small_shards}"]
    kill_twice_and_compare(tmp_path, overrides, kills=(6, 11), max_steps=14)
    checkpoints = saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")
    assert [step for step, _ in checkpoints] == [14, 12] and all(path.is_dir() for _, path in checkpoints)


def test_resuming_a_sharded_checkpoint_cannot_run_code(compose_train, tmp_path: Path) -> None:
    """FSDP2 on one process resumes a sharded checkpoint of its own whose index was replaced, sidecar and
    all (whoever can write a checkpoint can write its sidecar): refused, and the payload never ran."""
    one_process = [*SHARDED, "trainer.devices=1", "trainer.strategy.data_parallel_size=1"]
    train(compose_train(*one_process, "trainer.max_steps=6", "trainer.val_check_interval=6"))
    path = tmp_path / "checkpoints" / "step-000006.ckpt"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    record = json.loads(sidecar_path(path).read_text())
    record["files"][".metadata"] = {
        "bytes": (path / ".metadata").stat().st_size,
        "sha256": sha256_of(path / ".metadata"),
    }
    sidecar_path(path).write_text(json.dumps(record))
    verify(path)  # it passes for a good checkpoint
    refused = pytest.raises(
        CheckpointError, match=r"\.metadata cannot be read: it refers to \w+\.mkdir, .* could run code"
    )
    with own_process_group(), refused:  # as pretrain's job ends: the refusal leaves Lightning's process group
        train(compose_train(*one_process, "trainer.max_steps=12", "trainer.val_check_interval=6"))
    assert not marker.exists()
