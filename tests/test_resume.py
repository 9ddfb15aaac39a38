"""Exact resume: a run killed with SIGKILL and restarted (the same command, twice) trains on the
same batches with bitwise the same losses and ends with bitwise the same weights as a run that was
never interrupted. Each run is a real `pretrain` process; `kill.KillAt` kills its process group."""

from __future__ import annotations

import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback

from conftest import tiny_run
from pretraining.callbacks.batch_log import batch_log_differences, read_batch_log
from pretraining.checkpoint import CheckpointError, read_sidecar, saved_checkpoints
from pretraining.config import CONFIG_DIR, default_run_name, run_name
from pretraining.data.corpus import stdlib_root
from pretraining.data.documents import Document
from pretraining.data.manifest import Manifest
from pretraining.data.mixture import Mixture, SourceSettings
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.stream import stream_shard
from pretraining.errors import ConfigError
from pretraining.job_status import read_status
from pretraining.stored import load_checkpoint
from pretraining.train import train

TESTS = Path(__file__).parent
# Dropout on, so that the per-batch reseeding matters; checkpoints every 4 steps.
RESUMABLE = ["model.backbone.dropout=0.1", "callbacks=[default,batch_log]", "callbacks.checkpoint.every_n_steps=4"]
# The Llama backbone with grouped-query attention (2 query heads share 1 key/value head) and QK-norm. It
# has no dropout: the same masks of masked-LM and the same data order are what resume must replay.
LLAMA = [
    "model/backbone=llama",
    "model.backbone.n_kv_head=1",
    "model.backbone.qk_norm=true",
    "callbacks=[default,batch_log]",
    "callbacks.checkpoint.every_n_steps=4",
]
DDP = ["trainer=ddp_cpu"]
# A parametrization away from its base shape (twice the base width, half its depth: every rule differs from 1).
MUP = ["model.backbone.parametrization=mup", "model.backbone.base_width=16"]
COMPLETEP = ["model.backbone.parametrization=completep", "model.backbone.base_width=16", "model.backbone.base_depth=2"]
FSDP = ["trainer=fsdp_cpu"]


def pretrain_command(log_dir: Path, run: str, overrides: list[str]) -> list[str]:
    """The `pretrain` command of run `run` under `log_dir`, to run with `TEST_ENV` (tests/ importable)."""
    return [sys.executable, "-m", "pretraining", *overrides, f"paths.log_dir={log_dir}", f"run_name={run}"]


TEST_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def pretrain(log_dir: Path, run: str, overrides: list[str], kill_after: int | None = None) -> int:
    """Run `pretrain` in its own process group; its exit status (-9 if `kill_after` killed it)."""
    command = pretrain_command(log_dir, run, overrides)
    if kill_after is not None:
        command += ["+callbacks.kill._target_=kill.KillAt", f"+callbacks.kill.batch={kill_after}"]
    process = subprocess.Popen(command, env=TEST_ENV, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    if process.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"pretrain exited with {process.returncode}:\n{stderr[-3000:]}")
    return process.returncode


def run_dir(log_dir: Path, run: str) -> Path:
    return log_dir / "train" / "runs" / run


def final_weights(log_dir: Path, run: str) -> dict[str, torch.Tensor]:
    (_, newest), *_ = saved_checkpoints(run_dir(log_dir, run) / "checkpoints")
    return load_checkpoint(newest)["state_dict"]  # a file, or the shards of a directory gathered


def batch_logs(log_dir: Path, run: str) -> dict[str, dict]:
    return {path.name: read_batch_log(path) for path in sorted((run_dir(log_dir, run) / "batches").glob("*.jsonl"))}


def kill_twice_and_compare(
    log_dir: Path, overrides: list[str], kills: tuple[int, int], max_steps: int, accumulate: int = 1
) -> None:
    """An uninterrupted run against one killed after batches `kills` and restarted after each
    (`accumulate` micro-batches per step, of the global batch of 4)."""
    micro_batch = 4 // accumulate if accumulate > 1 else "null"
    overrides = [*overrides, f"trainer.max_steps={max_steps}", f"data.micro_batch_size={micro_batch}"]
    assert pretrain(log_dir, "reference", overrides) == 0
    for batch in kills:
        assert pretrain(log_dir, "killed", overrides, kill_after=batch) == -signal.SIGKILL
    assert pretrain(log_dir, "killed", overrides) == 0
    assert_same_training(log_dir, "reference", "killed", max_steps * accumulate)
    # Each restart went back to a checkpoint (every 4 steps) taken before its kill, not to the start.
    logged = [json.loads(line)["batch"] for line in (run_dir(log_dir, "killed") / "batches" / "rank0.jsonl").open()]
    restarts = [(before, after) for before, after in itertools.pairwise(logged) if after != before + 1]
    assert len(restarts) == len(kills)
    for (before, after), kill in zip(restarts, kills, strict=True):
        assert (after - 1) % (4 * accumulate) == 0 and 1 < after <= before <= kill


def assert_same_training(log_dir: Path, reference_run: str, resumed_run: str, batches: int) -> None:
    """Per rank, the same samples and bitwise the same loss at every batch, and the same final weights."""
    logs = batch_logs(log_dir, reference_run)
    assert logs and all(len(log) == batches for log in logs.values())
    differences = batch_log_differences(*(run_dir(log_dir, run) / "batches" for run in (reference_run, resumed_run)))
    assert not differences, f"batches or losses differ after a resume: {differences[:5]}"
    expected, actual = final_weights(log_dir, reference_run), final_weights(log_dir, resumed_run)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "final weights differ"


def test_next_token_with_two_workers_across_shards_and_epochs(tmp_path: Path, small_shards: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}", "data.num_workers=2"]
    kill_twice_and_compare(tmp_path, [*overrides, "callbacks.checkpoint.keep_every=8"], kills=(10, 19), max_steps=24)
    checkpoints = saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")
    assert [step for step, _ in checkpoints] == [24, 20, 16, 8]  # the newest two, and every 8th for good
    # The resumes (from steps 8 and 16) started inside a shard, and the run went on into the next epoch.
    num_shards = len(Manifest.load(small_shards).urls("train"))
    epochs = []
    for _, path in reversed(checkpoints):
        cursors = torch.load(path, weights_only=True)["ShardDataModule"]["cursors"]
        assert len(cursors) == 4 and any(block > 0 for *_, block in cursors)  # 2 streams x 2 workers
        epochs.append(max(stream_shard(shard, sub, 4, num_shards, 1234)[0] for _, sub, shard, _ in cursors))
    assert epochs[0] == 0 and epochs[-1] >= 1


@pytest.mark.slow  # three runs; the skip of a checkpoint without its sidecar is in tests/test_checkpoint.py
def test_a_kill_during_the_first_save_leaves_a_run_that_the_same_command_continues(
    tmp_path: Path, small_shards: Path
) -> None:
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}", "trainer.max_steps=8"]
    killed = [*overrides, "+callbacks.kill._target_=kill.KillBeforeTheFirstSidecar"]
    assert pretrain(tmp_path, "killed", killed) == -signal.SIGKILL
    checkpoints = run_dir(tmp_path, "killed") / "checkpoints"
    assert [path.name for path in checkpoints.iterdir()] == ["step-000004.ckpt"]  # renamed, no sidecar
    assert pretrain(tmp_path, "killed", overrides) == 0  # starts again, and saves step 4 over the unfinished one
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [8, 4]
    expected, actual = final_weights(tmp_path, "reference"), final_weights(tmp_path, "killed")
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "final weights differ"


EARLY_STOP = [  # stops at the second validation: not better by 100
    "+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.early_stop.monitor=val/loss",
    "+callbacks.early_stop.patience=0",
    "+callbacks.early_stop.min_delta=100",
]


@pytest.mark.slow  # five runs; a stop inside a gradient accumulation is in the fast suite
def test_an_early_stop_or_a_time_limit_saves_the_step_records_it_and_the_same_command_continues(
    tmp_path: Path, small_shards: Path
) -> None:
    overrides = [*tiny_run("clm_tiny"), f"data.dir={small_shards}", "callbacks.checkpoint.every_n_steps=100"]
    early = [*overrides, "trainer.max_steps=30", *EARLY_STOP]
    directory = run_dir(tmp_path, "early")
    for _ in range(2):  # validations every 6 steps; run again, the run EarlyStopping stopped stays stopped
        assert pretrain(tmp_path, "early", early) == 0
        record = read_status(directory)
        assert (record["status"], record["step"]) == ("stopped", 12)
        assert record["stopped_by"].startswith("EarlyStopping stopped it (Monitored metric val/loss did not improve")
        step, path = saved_checkpoints(directory / "checkpoints")[0]
        assert step == 12 and read_sidecar(path)["validation"]["val/loss"] > 0  # no validation owed
    with (directory / "csv" / "metrics.csv").open() as file:
        validated = [int(row["step"]) for row in csv.DictReader(file) if row["val/loss"]]
    assert validated == [0, 6, 12]  # each once: no final validation at a stop, none repeated on resume

    timed = [*overrides, "trainer.max_steps=100000", "trainer.max_time=00:00:00:02"]
    steps = []
    for _ in range(2):  # the limit is each process's: the second has its own 2 s
        assert pretrain(tmp_path, "timed", timed) == 0
        record = read_status(run_dir(tmp_path, "timed"))
        assert (record["status"], record["stopped_by"]) == ("stopped", "trainer.max_time")
        steps.append(saved_checkpoints(run_dir(tmp_path, "timed") / "checkpoints")[0][0])
        assert steps[-1] == record["step"]
    assert 0 < steps[0] < steps[1]


@pytest.mark.slow  # the objectives share the resume path: next-token's is in the fast suite
def test_masked_lm(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("mlm_tiny"), *RESUMABLE, f"data.dir={shard_dir}"]
    kill_twice_and_compare(tmp_path, overrides, kills=(5, 10), max_steps=12)


@pytest.mark.slow  # the objectives share the resume path: next-token's is in the fast suite
def test_contrastive(tmp_path: Path, negatives_dir: Path) -> None:
    """With mined hard negatives and GradCache's chunks (dropout's masks replayed in each recomputation)."""
    overrides = [*tiny_run("contrastive_tiny"), *RESUMABLE, f"data.dir={negatives_dir}", "data.num_workers=2"]
    overrides += ["data.format.hard_negatives=2", "model.grad_cache_chunk=3"]
    kill_twice_and_compare(tmp_path, overrides, kills=(5, 10), max_steps=12)


MUON_WSD = ["model/optimizer=muon", "model.schedule=wsd", "model.decay_steps=4"]


@pytest.mark.slow  # three runs; the schedule's continuation rules: tests/test_schedules.py
def test_a_wsd_run_extended_in_its_stable_phase_trains_as_if_planned_longer(tmp_path: Path, small_shards: Path) -> None:
    """A run of 12 steps (decay from step 8) killed after batch 10 and continued, from its step-8 checkpoint,
    with trainer.max_steps=16: bitwise the run that had 16 steps from the start. Continued again, now in its
    decay, with 20, it is refused."""
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, *MUON_WSD, f"data.dir={small_shards}"]
    assert pretrain(tmp_path, "reference", [*overrides, "trainer.max_steps=16"]) == 0
    killed = pretrain(tmp_path, "extended", [*overrides, "trainer.max_steps=12"], kill_after=10)
    assert killed == -signal.SIGKILL
    assert pretrain(tmp_path, "extended", [*overrides, "trainer.max_steps=16"]) == 0
    assert_same_training(tmp_path, "reference", "extended", 16)
    with pytest.raises(AssertionError, match=r"the checkpoint \(step 16\) is in its LR decay \(steps 12 to 16\)"):
        pretrain(tmp_path, "extended", [*overrides, "trainer.max_steps=20"])


@pytest.mark.slow  # 35 s; the stream's accumulation layouts resume exactly in tests/test_stream.py
def test_gradient_accumulation(tmp_path: Path, small_shards: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}"]
    kill_twice_and_compare(tmp_path, overrides, kills=(10, 15), max_steps=8, accumulate=2)


@pytest.fixture(scope="module")
def mixture(small_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A mixture of `small_shards` (0.7) and shards as small of another file (0.3), both crossing shards and
    epochs in a short run: as `data.sources` overrides."""
    source = (stdlib_root() / "json" / "encoder.py").read_text()
    documents = [Document(f"doc{i}", {"txt": source[i * 300 : (i + 1) * 300]}) for i in range(24)]
    other = tmp_path_factory.mktemp("data") / "other"
    build_shards(documents, other, ["json/encoder.py"], BuildSettings(0.25, max_shard_bytes=800), show_progress=False)
    return ["data.dir=null", f"data.sources={{a:{{dir:'{small_shards}',weight:0.7}},b:{{dir:'{other}',weight:0.3}}}}"]


def check_mixture_position(log_dir: Path, steps: int, sub_streams: int) -> None:
    """The killed run's last data position: every (source, sub-stream)'s cursor, from every rank, and the
    examples each source gave, as the mixture draws them."""
    position = load_checkpoint(run_dir(log_dir, "killed") / "checkpoints" / "last.ckpt")["ShardDataModule"]
    saved = {(name, sub) for name, sub, _, _ in position["cursors"]}
    assert saved == {(name, sub) for name in "ab" for sub in range(sub_streams)}
    sources = [SourceSettings("a", "", 0.7), SourceSettings("b", "", 0.3)]
    drawn = Counter(Mixture(sources, seed=1234).source_of(k) for k in range(steps * 4))  # the tiny run's seed, batch
    assert position["steps"] == steps and position["drawn"] == {"a": drawn[0], "b": drawn[1]}


# Each of the next three kills a run twice and compares it with the uninterrupted one, in one process, under
# DDP and under FSDP2, each on a Llama backbone and a two-source mixture: the resume paths they share with
# GPT-2 and one directory are killed in the fast suite (test_next_token_with_two_workers_across_shards_and_epochs)
# and in tests/test_scale.py, tests/test_sharded_checkpoint.py.


@pytest.mark.slow  # three runs; the optimizer and schedule round trips: tests/test_optimizers.py, test_schedules.py
def test_the_llama_backbone_with_muon_and_wsd_on_a_mixture_with_two_workers(tmp_path: Path, mixture: list[str]) -> None:
    """Killed in the stable phase (batch 6) and in the decay (batch 11, decay from step 8 of 12), under
    completep."""
    overrides = [*tiny_run("clm_tiny"), *LLAMA, *MUON_WSD, *COMPLETEP, *mixture, "data.num_workers=2"]
    kill_twice_and_compare(tmp_path, overrides, kills=(6, 11), max_steps=12)
    check_mixture_position(tmp_path, steps=12, sub_streams=4)  # 2 streams, each in a sub-stream per worker


@pytest.mark.distributed
@pytest.mark.slow  # two processes per run
def test_ddp_on_two_processes_with_two_workers(tmp_path: Path, mixture: list[str]) -> None:
    """Masked-LM with dropout, under mup: its masks and dropout are keyed on the sample and the step's slot."""
    overrides = [
        *tiny_run("mlm_tiny"),
        *LLAMA,
        "model.backbone.dropout=0.1",
        *DDP,
        *MUP,
        *mixture,
        "data.num_workers=2",
    ]
    kill_twice_and_compare(tmp_path, overrides, kills=(6, 11), max_steps=14)
    # Rank zero's checkpoint holds every rank's data position (each rank reads one of the 2 streams,
    # in 2 sub-streams, one per worker, of each source).
    check_mixture_position(tmp_path, steps=14, sub_streams=4)


@pytest.mark.distributed
@pytest.mark.slow  # two processes per run
def test_fsdp2_with_activation_checkpointing_on_two_processes(tmp_path: Path, mixture: list[str]) -> None:
    """Each Llama DecoderLayer an FSDP2 unit, recomputed in backward; the sharded checkpoints name its
    parameters `layers.0.self_attn.q_proj.weight` ..., as Hugging Face does. Under completep."""
    checkpointed = "trainer.strategy.activation_checkpointing=true"
    overrides = [*tiny_run("clm_tiny"), *LLAMA, *FSDP, *COMPLETEP, checkpointed, *mixture]
    kill_twice_and_compare(tmp_path, overrides, kills=(6, 11), max_steps=14)
    assert "backbone.layers.0.self_attn.q_proj.weight" in final_weights(tmp_path, "killed")
    check_mixture_position(tmp_path, steps=14, sub_streams=2)


class Unseeded(Callback):
    """Draws every batch's randomness afresh, after the DataModule seeded it from the step: as a run that
    did not key its randomness on the data position."""

    def on_train_batch_start(self, *args: Any) -> None:
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))


@pytest.mark.slow  # a control: seeding each micro-batch is what makes the losses equal
def test_without_reseeding_the_losses_differ(tmp_path: Path, small_shards: Path) -> None:
    """The negative control: the same kills without the DataModule's reseeding give the same batches, other
    losses."""
    unseeded = "+callbacks.unseeded._target_=test_resume.Unseeded"
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}", unseeded]
    with pytest.raises(AssertionError, match="batches or losses differ"):
        kill_twice_and_compare(tmp_path, overrides, kills=(6, 10), max_steps=12)
    reference, resumed = batch_logs(tmp_path, "reference"), batch_logs(tmp_path, "killed")
    samples = [
        {batch: record["samples"] for batch, record in log["rank0.jsonl"].items()} for log in (reference, resumed)
    ]
    assert samples[0] == samples[1]


def stop_with_sigterm(log_dir: Path, overrides: list[str], send: Callable[[subprocess.Popen], None]) -> int:
    """Start the run "term", `send` it SIGTERM once rank 1 (or 0) has trained 5 batches, check that it
    exits with 143 and all its processes end; the step it saved."""
    command = pretrain_command(log_dir, "term", overrides)
    stderr = (log_dir / "stderr.txt").open("w")  # a file, not a pipe nobody reads while we wait
    process = subprocess.Popen(command, start_new_session=True, stderr=stderr, text=True)
    logs = run_dir(log_dir, "term") / "batches"
    deadline = time.monotonic() + 120
    while not any(len(log.read_text().splitlines()) >= 5 for log in logs.glob("*.jsonl")):
        assert process.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    send(process)
    process.wait(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, (log_dir / "stderr.txt").read_text()[-3000:]
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-g", str(process.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a process of the run did not exit"
        time.sleep(0.1)
    ((step, _),) = saved_checkpoints(run_dir(log_dir, "term") / "checkpoints")
    record = read_status(run_dir(log_dir, "term"))
    assert (record["status"], record["step"], record["stopped_by"]) == ("stopped", step, "SIGTERM")
    for log in logs.glob("*.jsonl"):
        # Saved where it stopped: after the last step trained (steps count from 0 in the log).
        assert max(record["step"] for record in read_batch_log(log).values()) == step - 1
    return step


@pytest.mark.slow  # the one-process signal tests below stay in the fast suite
def test_sigterm_to_every_process_with_loader_workers(tmp_path: Path, small_shards: Path) -> None:
    """A scheduler signals the whole job: the DataLoader workers must not die before the save."""
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}", "data.num_workers=2"]
    overrides += ["trainer.max_steps=80", "callbacks.checkpoint.every_n_steps=1000"]
    assert 5 <= stop_with_sigterm(tmp_path, overrides, lambda process: os.killpg(process.pid, signal.SIGTERM)) < 80
    assert pretrain(tmp_path, "term", overrides) == 0
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "term", 80)


# --- in one process: auto-resume, starting over, and the checks before a resume -------------------------


def test_running_again_continues_from_the_newest_checkpoint(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    metrics = train(compose_train("trainer.max_steps=12"))
    assert "val/loss" in metrics
    newest = tmp_path / "checkpoints" / "step-000012.ckpt"
    lineage = torch.load(newest, weights_only=True)["lineage"]
    assert lineage["parent"] == str(tmp_path / "checkpoints" / "step-000006.ckpt") and lineage["step"] == 12
    assert lineage["topology"] == {
        "global_batch_size": 4,
        "streams": 2,
        "workers": 1,
        "accumulation": 1,
        "seed": 1234,
        "shuffle_buffer": 4096,
        "block_size": 64,
        "text_field": "txt",
    }
    # The metrics file goes on from the first run's rows (Lightning's own CSV logger would delete them).
    with (tmp_path / "csv" / "metrics.csv").open() as file:
        validated = [int(row["step"]) for row in csv.DictReader(file) if row["val/loss"]]
    assert validated == [0, 6, 12]


def test_resume_never_moves_the_earlier_run_aside(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    train(compose_train("trainer.max_steps=6", "resume=never"))
    (aside,) = tmp_path.glob("replaced-*")
    assert (aside / "checkpoints" / "step-000006.ckpt").is_file()
    lineage = torch.load(tmp_path / "checkpoints" / "step-000006.ckpt", weights_only=True)["lineage"]
    assert lineage["parent"] is None


def test_an_explicit_checkpoint_is_resumed(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    source = tmp_path / "checkpoints" / "step-000006.ckpt"
    other = tmp_path / "other"
    train(compose_train("trainer.max_steps=12", f"ckpt_path={source}", f"paths.output_dir={other}"))
    assert torch.load(other / "checkpoints" / "step-000012.ckpt", weights_only=True)["lineage"]["parent"] == str(source)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ["data.global_batch_size=8"],
            r"topology: the checkpoint has .*'global_batch_size': 4.*this run has .*'global_batch_size': 8",
        ),
        (["model.backbone.d_model=64"], r"holds another model: parameter backbone\..* has shape \[.*32.*\] there"),
        (["resume=sometimes"], r"resume='sometimes' is not one of 'auto', 'never': change resume"),
        (["resume_allow=[everything]"], r"resume_allow\[0\]='everything' is not one of 'data', 'tokenizer'"),
        (MUP, r"trained under model.backbone.parametrization=standard, and this run builds mup at 2x its base width"),
    ],
    ids=["batch_size", "model", "resume_mode", "allow", "parametrization"],
)
def test_a_resume_that_does_not_fit_is_refused_before_any_work(compose_train, tmp_path: Path, change, message) -> None:
    train(compose_train("trainer.max_steps=6"))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises((CheckpointError, ConfigError), match=message):
        train(compose_train("trainer.max_steps=12", *change))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_other_data_or_accumulation_is_refused_unless_allowed(
    compose_train, tmp_path: Path, small_shards: Path
) -> None:
    train(compose_train("trainer.max_steps=6"))
    other_data = r"data: the checkpoint has \w+, this run has \w+ \(point data\.dir \(or data\.sources\) at"
    with pytest.raises(CheckpointError, match=other_data):
        train(compose_train("trainer.max_steps=12", f"data.dir={small_shards}"))
    sidecar = tmp_path / "checkpoints" / "step-000006.ckpt.json"
    record = json.loads(sidecar.read_text())
    record["lineage"]["topology"]["accumulation"] = 2  # as if written with micro-batches of 2
    sidecar.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"(?s)'accumulation': 2.*'accumulation': 1.*resume_allow=\[topology\]"):
        train(compose_train("trainer.max_steps=12"))
    with pytest.warns(UserWarning, match=r"the shards of data\.dir are not the checkpoint's: they are read from"):
        train(compose_train("trainer.max_steps=12", f"data.dir={small_shards}", "resume_allow=[data,topology]"))
    assert (tmp_path / "checkpoints" / "step-000012.ckpt").is_file()


def test_a_checkpoint_of_another_lineage_format_is_not_resumed(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    sidecar = tmp_path / "checkpoints" / "step-000006.ckpt.json"
    record = json.loads(sidecar.read_text())
    record["lineage"]["format"] = 3  # as the layout before data.format wrote it
    sidecar.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"lineage format 3, this code writes 4.*code revision that wrote it"):
        train(compose_train("trainer.max_steps=12"))
    assert not (tmp_path / "checkpoints" / "step-000012.ckpt").exists()


def test_run_names_are_stable_for_a_command_and_ignore_how_it_resumes() -> None:
    def name(*overrides: str) -> str:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            return default_run_name()
        finally:
            HydraConfig.instance().cfg = None  # later tests compose outside a Hydra run

    assert name("experiment=mlm_tiny") == "mlm_tiny"
    assert name() == "default"
    longer = name("experiment=clm_tiny", "trainer.max_steps=50")
    assert longer.startswith("clm_tiny-") and longer == name("trainer.max_steps=50", "experiment=clm_tiny")
    assert name("experiment=clm_tiny", "trainer.max_steps=50", "resume=never", "ckpt_path=x") == longer
    assert name("experiment=clm_tiny", "trainer.max_steps=60") != longer
    assert run_name("team/clm", []) == "team-clm"  # an experiment in a folder of its own: one directory still


@pytest.mark.parametrize(
    ("stop", "step"),
    [
        (["+callbacks.stop._target_=kill.StopAt", "+callbacks.stop.batch=9"], 5),
        # EarlyStopping's at the end of a validation: every 3 steps (not micro-batches), at the first one
        (["trainer.val_check_interval=3", *EARLY_STOP[:2], "+callbacks.early_stop.stopping_threshold=1e9"], 3),
    ],
    ids=["callback", "early_stopping"],
)
def test_a_stop_with_gradient_accumulation_saves_the_step_and_the_run_continues_exactly(
    compose_train, tmp_path: Path, stop: list[str], step: int
) -> None:
    """A callback ends training, with steps of 2 micro-batches (inside one, or by a validation): the run stops
    at the step's end, saves it before the validation Lightning runs at a stop (recorded in its sidecar), and
    the same command continues it to the weights of a run never stopped."""
    accumulate = ["data.micro_batch_size=2", "callbacks.checkpoint.every_n_steps=100"]
    train(compose_train(*accumulate, *stop))
    checkpoints = tmp_path / "checkpoints"
    ((saved_step, saved),) = saved_checkpoints(checkpoints)
    assert saved_step == step and load_checkpoint(saved)["ShardDataModule"]["steps"] == step
    assert "val/loss" in read_sidecar(saved)["validation"]
    train(compose_train(*accumulate))
    assert [step for step, _ in saved_checkpoints(checkpoints)] == [12, step]
    train(compose_train(*accumulate, f"paths.output_dir={tmp_path / 'reference'}"))
    expected = load_checkpoint(tmp_path / "reference" / "checkpoints" / "step-000012.ckpt")["state_dict"]
    actual = load_checkpoint(checkpoints / "step-000012.ckpt")["state_dict"]
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "final weights differ"


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **variables: str) -> Path:
    """A SLURM job's variables, and an `scontrol` on PATH that records how it was called (in the returned file)."""
    log = tmp_path / "scontrol.log"
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir(exist_ok=True)
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in {"SLURM_JOB_ID": "4242", **variables}.items():
        monkeypatch.setenv(name, value)
    return log


@pytest.mark.parametrize(
    ("signum", "array_task", "requeued"),
    [
        (signal.SIGUSR1, None, "requeue 4242\n"),
        (signal.SIGUSR1, "1", "requeue 4240_1\n"),  # an array's task alone, not the array (its job id may be it)
        (signal.SIGTERM, None, None),  # scancel, or a preemption that SLURM requeues itself
        (signal.SIGINT, None, None),  # a person stopped it
    ],
    ids=["SIGUSR1", "SIGUSR1-array-task", "SIGTERM", "SIGINT"],
)
def test_a_signal_saves_at_the_next_step_boundary_and_only_the_notice_requeues_under_slurm(
    compose_train, tmp_path: Path, monkeypatch, signum: int, array_task: str | None, requeued: str | None
) -> None:
    array = {"SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": array_task} if array_task else {}
    log = fake_slurm(tmp_path, monkeypatch, **array)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    signal_at = [
        "+callbacks.signal._target_=kill.SignalAt",
        "+callbacks.signal.batch=3",
        f"+callbacks.signal.signum={signum}",
    ]
    with pytest.raises(SystemExit) as stopped:
        train(compose_train(*signal_at))
    assert stopped.value.code == 128 + signum
    assert [step for step, _ in saved_checkpoints(tmp_path / "checkpoints")] == [4]  # the boundary after the signal
    assert (log.read_text() if log.exists() else None) == requeued
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the handlers from before training are back
