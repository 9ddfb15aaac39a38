"""torchrun across nodes: two `scripts/launch_torchrun.sh` on this host, as two nodes of one rank each. A run whose
torchrun agents both die by SIGKILL (their ranks die with them), or are both sent SIGTERM, continues
when the same two commands start again, and ends on the same batches with bitwise the same losses and weights
as the run never interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer

from conftest import free_port, tiny_run
from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.checkpoint import saved_checkpoints
from pretraining.config import PROJECT_ROOT
from pretraining.job_status import read_status
from test_resume import RESUMABLE, TEST_ENV, assert_same_training, run_dir

SCRIPT = PROJECT_ROOT / "scripts" / "launch_torchrun.sh"
# 12 steps, a checkpoint every 4; dropout on, so that each batch's reseeding matters.
OVERRIDES = [*tiny_run("clm_tiny"), *RESUMABLE, "~callbacks.text_sample"]
HOLD_BATCH = 6  # two steps after the checkpoint of step 4


class HoldAt(Callback):
    """After training batch `batch`, once the checkpoint being written is complete, write `<markers>/rank<N>.json`
    (this process's id) and wait there: for the SIGKILL of its node or, with `until_signal`, for a SIGTERM to this
    process, which then takes its course (the run saves at the next step boundary)."""

    def __init__(self, batch: int, markers: str, until_signal: bool = False) -> None:
        self.batch, self.markers, self.until_signal = batch, Path(markers), until_signal

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.datamodule.position.batches_consumed != self.batch:  # type: ignore[attr-defined]
            return
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, StepCheckpoint):
                checkpoint.wait_until_written(trainer)
        received = threading.Event()
        previous = signal.getsignal(signal.SIGTERM)

        def note(signum: int, frame: Any) -> None:
            received.set()
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, note)
        self.markers.mkdir(parents=True, exist_ok=True)
        marker = self.markers / f"rank{trainer.global_rank}.json"
        marker.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid()}))
        marker.with_suffix(".tmp").rename(marker)
        while not (self.until_signal and received.is_set()):
            received.wait(0.05)
        signal.signal(signal.SIGTERM, previous)


def hold(markers: Path, until_signal: bool = False) -> list[str]:
    return [
        f"+callbacks.hold._target_={__name__}.HoldAt",
        f"+callbacks.hold.batch={HOLD_BATCH}",
        f"+callbacks.hold.markers={markers}",
        f"+callbacks.hold.until_signal={str(until_signal).lower()}",
    ]


def start_nodes(log_dir: Path, run: str, overrides: list[str]) -> list[subprocess.Popen]:
    """The same command on two nodes, NODE_RANK 0 and 1, each a torchrun agent in a process group of its own."""
    env = {
        **TEST_ENV,
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "TRAINER": "ddp_cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
    }
    command = [str(SCRIPT), *OVERRIDES, "trainer.devices=1", *overrides, f"paths.log_dir={log_dir}", f"run_name={run}"]
    nodes = []
    for rank in range(2):
        output = (log_dir / f"{run}-node{rank}.txt").open("a")  # a file, not a pipe nobody reads while we wait
        node_env = {**env, "NODE_RANK": str(rank)}
        nodes.append(subprocess.Popen(command, env=node_env, start_new_session=True, stdout=output, stderr=output))
    return nodes


def wait_for(nodes: list[subprocess.Popen], log_dir: Path, run: str) -> list[int]:
    """Each node's exit status; on a timeout, every process of both nodes is killed."""
    try:
        return [node.wait(timeout=120) for node in nodes]
    except subprocess.TimeoutExpired:
        kill_nodes(nodes)
        raise AssertionError(node_output(log_dir, run)) from None


def node_output(log_dir: Path, run: str) -> str:
    return "\n".join((log_dir / f"{run}-node{rank}.txt").read_text()[-2000:] for rank in range(2))


def run_nodes(log_dir: Path, run: str, overrides: list[str]) -> None:
    statuses = wait_for(start_nodes(log_dir, run, overrides), log_dir, run)
    assert statuses == [0, 0], node_output(log_dir, run)


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid: (parent, process group, state) of every process on this host."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        state, parent, group = text[text.rindex(")") + 2 :].split()[:3]
        table[int(stat.parent.name)] = (int(parent), int(group), state)
    return table


def node_processes(nodes: list[subprocess.Popen]) -> dict[int, int]:
    """pid: process group of each agent and every process below it (torchrun starts each rank in a session of
    its own: killing the agent's group alone would leave the ranks training)."""
    table = process_table()
    found = {node.pid for node in nodes}
    while grown := {pid for pid, (parent, _, _) in table.items() if parent in found} - found:
        found |= grown
    return {pid: table[pid][1] for pid in found if pid in table}


def kill_nodes(nodes: list[subprocess.Popen]) -> dict[int, int]:
    """SIGKILL every process group of both nodes, as a node failure or a scheduler's kill; the processes killed."""
    processes = node_processes(nodes)
    for group in set(processes.values()):
        with contextlib.suppress(ProcessLookupError):  # all its processes ended meanwhile
            os.killpg(group, signal.SIGKILL)
    for node in nodes:
        node.wait(timeout=30)
    return processes


def assert_gone(processes: dict[int, int]) -> None:
    """No process of `processes`' groups is left (a zombie no parent reaped has ended: its pid holds nothing)."""
    groups, deadline = set(processes.values()), time.monotonic() + 30
    while left := [pid for pid, (_, group, state) in process_table().items() if group in groups and state != "Z"]:
        assert time.monotonic() < deadline, f"processes of the killed run are left: {left}"
        time.sleep(0.1)


def wait_for_markers(nodes: list[subprocess.Popen], markers: Path, log_dir: Path, run: str) -> set[int]:
    """The pids of both ranks, once each holds at `HOLD_BATCH`."""
    deadline = time.monotonic() + 120
    while len(found := list(markers.glob("rank*.json"))) < 2:
        if any(node.poll() is not None for node in nodes) or time.monotonic() > deadline:
            kill_nodes(nodes)
            raise AssertionError(f"the ranks did not reach batch {HOLD_BATCH}:\n{node_output(log_dir, run)}")
        time.sleep(0.05)
    return {json.loads(path.read_text())["pid"] for path in found}


def batches_logged(log_dir: Path, run: str) -> dict[str, list[int]]:
    """Per rank, the batches its log records, in the order written (across restarts)."""
    logs = sorted((run_dir(log_dir, run) / "batches").glob("*.jsonl"))
    return {log.stem: [json.loads(line)["batch"] for line in log.read_text().splitlines()] for log in logs}


@pytest.mark.distributed
@pytest.mark.slow  # five runs of two nodes (about 7 s each); one node's torchrun: tests/test_launch.py
def test_two_nodes_killed_or_signalled_and_started_again_train_as_if_never_stopped(
    tmp_path: Path, small_shards: Path
) -> None:
    data = [f"data.dir={small_shards}"]
    run_nodes(tmp_path, "reference", data)

    # Both torchrun agents die by SIGKILL (their process groups, which the ranks are not in: torchrun starts each
    # in a session of its own), two steps after the checkpoint of step 4; each rank must die with its agent.
    markers = tmp_path / "held-killed"
    nodes = start_nodes(tmp_path, "killed", [*data, *hold(markers)])
    ranks = wait_for_markers(nodes, markers, tmp_path, "killed")
    killed = node_processes(nodes)
    assert ranks <= killed.keys() and {killed[pid] for pid in ranks}.isdisjoint(node.pid for node in nodes)
    for node in nodes:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=30)
    assert [node.returncode for node in nodes] == [-signal.SIGKILL, -signal.SIGKILL]
    assert_gone(killed)
    assert [step for step, _ in saved_checkpoints(run_dir(tmp_path, "killed") / "checkpoints")] == [4]
    run_nodes(tmp_path, "killed", data)  # the same two commands again
    assert_same_training(tmp_path, "reference", "killed", 12)
    # It continued from the checkpoint of step 4: each rank's log goes back once, from batch 6 to batch 5.
    assert batches_logged(tmp_path, "killed") == {rank: [*range(1, 7), *range(5, 13)] for rank in ("rank0", "rank1")}

    # SIGTERM to both torchrun agents: each passes it to its rank, and the ranks save the step they are at.
    markers = tmp_path / "held-term"
    nodes = start_nodes(tmp_path, "term", [*data, *hold(markers, until_signal=True)])
    ranks = wait_for_markers(nodes, markers, tmp_path, "term")
    processes = node_processes(nodes)
    assert ranks <= processes.keys()
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    # Each agent outlives the signal to stop its rank, then exits on its own (torchrun's status is 1, not 143).
    assert all(status > 0 for status in wait_for(nodes, tmp_path, "term")), node_output(tmp_path, "term")
    assert_gone(processes)
    record = read_status(run_dir(tmp_path, "term"))
    assert (record["status"], record["step"], record["stopped_by"]) == ("stopped", HOLD_BATCH, "SIGTERM")
    assert [step for step, _ in saved_checkpoints(run_dir(tmp_path, "term") / "checkpoints")] == [HOLD_BATCH, 4]
    run_nodes(tmp_path, "term", data)
    assert_same_training(tmp_path, "reference", "term", 12)
    # It continued from the step it saved: each rank's log has each batch once.
    assert batches_logged(tmp_path, "term") == {rank: list(range(1, 13)) for rank in ("rank0", "rank1")}
