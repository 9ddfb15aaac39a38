"""The SLURM paths on a real SLURM: a throwaway two-node cluster on this host (`slurm_cluster.py`) runs the project's
own `scripts/launch_slurm.sh` and the submitit launcher. SLURM's notice (USR1, as `--signal=USR1@N` sends it to the
tasks) saves at the next step boundary and requeues the job, an array's task alone, also during the start-up; the
requeued job continues bitwise as if never stopped. A plain `scancel` (SIGTERM) saves and stays cancelled. Needs
root and Debian's SLURM and munge: skipped without them, failed under CI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port, tiny_run
from pretraining.checkpoint import saved_checkpoints
from pretraining.job_status import read_status
from slurm_cluster import SlurmCluster, processes_with, require_cluster
from test_resume import DDP, RESUMABLE, TEST_ENV, assert_same_training, pretrain_command, run_dir

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # a SLURM cluster and its jobs: about 2 minutes on 2 cores

ROOT = Path(__file__).parent.parent
STEPS = 16
# Half a second a step: time to signal a run from outside, mid-training (a sleep changes no result).
SLOW = ["+callbacks.sleep._target_=kill.SleepEachStep", "+callbacks.sleep.seconds=0.5"]
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def training(shards: Path) -> list[str]:
    """A tiny run of STEPS steps saved only at its end, or where a signal stops it: a resume that starts past step 0
    shows that the stop saved."""
    return [
        *tiny_run("clm_tiny"),
        *RESUMABLE,
        f"data.dir={shards}",
        f"trainer.max_steps={STEPS}",
        "callbacks.checkpoint.every_n_steps=100",
    ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_cluster()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def no_job_left(cluster: SlurmCluster) -> Iterator[None]:
    """A failed scenario's jobs do not run on into the next one."""
    yield
    if cluster.active_jobs():
        cluster.cancel_all()


def submit(cluster: SlurmCluster, log_dir: Path, run: str, overrides: list[str], nodes: int = 1) -> tuple[str, Path]:
    """`sbatch scripts/launch_slurm.sh` from the project's root, one task per node (DDP over nodes with more than
    one); the job's id and its output file."""
    job = cluster.sbatch(
        [
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            f"--output={log_dir}/{run}-%j.out",
            "scripts/launch_slurm.sh",
            "trainer.devices=1",  # one task per node: the CPU trial of docs/scale-out.md
            *overrides,
            f"paths.log_dir={log_dir}",
            f"run_name={run}",
        ],
        env={
            "PYTHONPATH": TEST_ENV["PYTHONPATH"],  # kill.SleepEachStep
            "TRAINER": "ddp_cpu" if nodes > 1 else "cpu",
            "MASTER_ADDR": "127.0.0.1",  # the node names do not resolve
            "MASTER_PORT": str(free_port()),  # not Lightning's pick from the job id, alike in every test's cluster
        },
        cwd=ROOT,
    )
    return job, log_dir / f"{run}-{job}.out"


def batches(directory: Path, rank: int = 0) -> list[dict]:
    """A run's batch log of one rank, line by line (a replayed batch twice)."""
    path = directory / "batches" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def wait_for_batches(cluster: SlurmCluster, job: str, directory: Path, count: int, timeout: float = 180) -> int:
    """Wait until the running job has logged `count` training batches; the number it had logged then."""

    def logged() -> bool:
        fields = cluster.job(job)
        if ended(fields):
            raise AssertionError(f"job {job} ended ({fields['JobState']}) before {count} batches")
        return len(batches(directory)) >= count

    cluster.wait_until(logged, timeout, f"{count} batches logged by job {job}")
    return len(batches(directory))


def ended(fields: dict[str, str]) -> bool:
    return fields["JobState"] in ENDED


def attempts(directory: Path) -> list[list[int]]:
    """The batches each attempt of a run trained, split where the batch log paused for longer than a requeue takes
    to restart a job (more than 10 s: the credential's expiry alone is 11 s, a step sleeps half a second)."""
    logged = batches(directory)
    runs: list[list[int]] = []
    for before, record in zip([None, *logged], logged, strict=False):
        if before is None or record["time"] - before["time"] > 10:
            runs.append([])
        runs[-1].append(record["batch"])
    return runs


def assert_stopped_once_at_the_step_it_saved(directory: Path, signalled_after: int, name: str) -> int:
    """The run trained every batch once, in two attempts: the first stopped (on `name`) at a step after
    `signalled_after`, saved there, and the second continued from it. The step it stopped at."""
    first, second = attempts(directory)
    stop = first[-1]
    assert first + second == list(range(1, STEPS + 1)), f"a batch replayed or skipped: {first} then {second}"
    assert signalled_after <= stop < STEPS
    assert f"{name} received: saving at step {stop} and stopping" in (directory / "train.log").read_text()
    assert [step for step, _ in saved_checkpoints(directory / "checkpoints")] == [STEPS, stop]
    return stop


def test_the_sbatch_script_on_two_nodes_saves_on_the_notice_requeues_itself_and_continues_bitwise(
    cluster: SlurmCluster, tmp_path: Path, small_shards: Path
) -> None:
    job, output = submit(cluster, tmp_path, "slurm", [*training(small_shards), *SLOW], nodes=2)
    directory = run_dir(tmp_path, "slurm")
    with cluster.explained(output, directory / "train.log"):
        seen = wait_for_batches(cluster, job, directory, 3)
        cluster.command("scancel", "--signal=USR1", job)  # to every task, as --signal=USR1@N
        # The uninterrupted run, meanwhile: two processes of plain DDP on this host train the same bits.
        command = pretrain_command(tmp_path, "reference", [*training(small_shards), *DDP])
        reference = subprocess.Popen(command, env=TEST_ENV, start_new_session=True, stderr=subprocess.PIPE, text=True)
        try:
            fields = cluster.wait_for_job(job, ended, 240, "its end")  # a requeue passes through PENDING
            _, stderr = reference.communicate(timeout=180)
        finally:
            if reference.poll() is None:
                os.killpg(reference.pid, signal.SIGKILL)
                reference.wait()
        assert reference.returncode == 0, stderr[-3000:]
        assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0")
        assert f"requeued SLURM job {job}" in output.read_text()
        assert len(batches(directory, rank=1)) == STEPS  # two ranks, one a node
        assert_stopped_once_at_the_step_it_saved(directory, seen, "SIGUSR1")
        assert read_status(directory)["status"] == "completed"
        assert_same_training(tmp_path, "reference", "slurm", STEPS)


def test_the_notice_to_one_task_of_a_submitit_sweep_requeues_that_task_alone(
    cluster: SlurmCluster, tmp_path: Path, small_shards: Path
) -> None:
    launcher = [
        "hydra/launcher=slurm",
        "trainer=cpu",
        "hydra.launcher.name=usr1-sweep",
        "hydra.launcher.nodes=1",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.gpus_per_node=0",
        "hydra.launcher.cpus_per_task=1",
    ]
    overrides = [*training(small_shards), *SLOW, *launcher, "model.optimizer.lr=1e-3,2e-3", f"paths.log_dir={tmp_path}"]
    output = tmp_path / "launcher.out"
    with output.open("w") as file:  # submitit's launcher waits for the jobs: it runs while the test signals
        sweep = subprocess.Popen(
            [sys.executable, "-m", "pretraining", "-m", *overrides],
            env={**cluster.env, "PYTHONPATH": TEST_ENV["PYTHONPATH"]},
            cwd=ROOT,
            start_new_session=True,
            stdout=file,
            stderr=subprocess.STDOUT,
        )
    try:
        with cluster.explained(output):
            tasks: list[str] = []

            def submitted() -> bool:
                if sweep.poll() is not None:
                    raise AssertionError(f"the launcher exited with {sweep.returncode} before its jobs ran")
                tasks[:] = cluster.command("squeue", "-h", "-r", "-n", "usr1-sweep", "-o", "%i").stdout.split()
                return len(tasks) == 2

            cluster.wait_until(submitted, 120, "the sweep's two array tasks")
            array = tasks[0].split("_")[0]
            assert sorted(tasks) == [f"{array}_0", f"{array}_1"], f"not one array job: {tasks}"
            cluster.wait_until(lambda: len(list(tmp_path.glob("train/multiruns/*/1"))) == 1, 120, "the sweep's jobs")
            (sweep_dir,) = tmp_path.glob("train/multiruns/*")
            seen = [wait_for_batches(cluster, f"{array}_{task}", sweep_dir / str(task), 3) for task in (0, 1)]
            cluster.command("scancel", "--signal=USR1", f"{array}_1")
            assert sweep.wait(timeout=240) == 0, "the launcher failed"
            # The launcher returns on the jobs' results, which a job writes before SLURM sees it end (COMPLETING).
            untouched, requeued = (cluster.wait_for_job(f"{array}_{t}", ended, 60, "its end") for t in (0, 1))
            assert (untouched["JobState"], untouched["Restarts"]) == ("COMPLETED", "0")
            assert (requeued["JobState"], requeued["Restarts"]) == ("COMPLETED", "1")
            assert [batch for run in attempts(sweep_dir / "0") for batch in run] == list(range(1, STEPS + 1))
            assert len(attempts(sweep_dir / "0")) == 1
            assert "received" not in (sweep_dir / "0" / "train.log").read_text()
            assert [step for step, _ in saved_checkpoints(sweep_dir / "0" / "checkpoints")] == [STEPS]
            assert_stopped_once_at_the_step_it_saved(sweep_dir / "1", seen[1], "SIGUSR1")
            assert [read_status(sweep_dir / str(task))["status"] for task in (0, 1)] == ["completed", "completed"]
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
            sweep.wait()


def test_scancel_saves_and_the_job_stays_cancelled(cluster: SlurmCluster, tmp_path: Path, small_shards: Path) -> None:
    job, output = submit(cluster, tmp_path, "cancelled", [*training(small_shards), *SLOW])
    directory = run_dir(tmp_path, "cancelled")
    with cluster.explained(output, directory / "train.log"):
        seen = wait_for_batches(cluster, job, directory, 3)
        cluster.command("scancel", job)  # SIGTERM to the tasks and the batch shell, SIGKILL after KillWait
        cluster.wait_until(lambda: job not in cluster.active_jobs(), 120, f"job {job} to leave the queue")
        time.sleep(5)  # a requeue would show now: the job pending or running again
        fields = cluster.job(job)
        assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0")
        assert job not in cluster.active_jobs()
        assert "requeued" not in output.read_text()
        record = read_status(directory)
        assert (record["status"], record["stopped_by"]) == ("stopped", "SIGTERM")
        (stop, _), *older = saved_checkpoints(directory / "checkpoints")
        assert stop == record["step"] and seen <= stop < STEPS and not older
        assert f"SIGTERM received: saving at step {stop} and stopping" in (directory / "train.log").read_text()


def test_the_notice_during_the_start_up_requeues_the_job(
    cluster: SlurmCluster, tmp_path: Path, small_shards: Path
) -> None:
    job, output = submit(cluster, tmp_path, "early", training(small_shards))
    directory = run_dir(tmp_path, "early")
    with cluster.explained(output):
        cluster.wait_until(lambda: starting(cluster, job, directory), 120, f"job {job}'s pretrain to start", every=0.05)
        cluster.command("scancel", "--signal=USR1", job)
        fields = cluster.wait_for_job(job, ended, 240, "its end")
        # (Its "requeued" line may be missing: the requeue's own SIGTERM can end the task before it prints.)
        assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0")
        assert attempts(directory) == [list(range(1, STEPS + 1))]  # nothing trained before the requeue
        assert "received: saving" not in (directory / "train.log").read_text()
        assert [step for step, _ in saved_checkpoints(directory / "checkpoints")] == [STEPS]
        assert read_status(directory)["status"] == "completed"


def starting(cluster: SlurmCluster, job: str, directory: Path) -> bool:
    """Whether job `job`'s `pretrain` task is in its start-up, with a handler for SLURM's notice: after the
    interpreter's own start (where nothing in Python can catch a signal), before training's handlers are in
    place (SIGTERM's, Lightning's or the template's, come with the Trainer) and before any step."""
    markers = f"SLURM_JOB_ID={job}".encode(), f"SLURM_CONF={cluster.conf}".encode()
    for pid in processes_with(*markers):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # gone
            continue
        if len(command) < 2 or Path(command[1].decode()).name != "pretrain":
            continue  # srun, which names pretrain too, or the batch shell
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & signal_bit(signal.SIGTERM) or batches(directory):
            raise AssertionError(
                f"job {job}'s pretrain had no handler for USR1 before training's were installed: SLURM's notice "
                "during the start-up ends the job there, unrequeued (exit 138)"
            )
        return bool(caught & signal_bit(signal.SIGUSR1))
    return False


def signal_bit(signum: int) -> int:
    """The bit of `signum` in /proc/<pid>/status's signal masks (SigCgt: the signals the process has handlers for)."""
    return 1 << (signum - 1)
