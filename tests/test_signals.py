"""A signal in any phase of a run ends it within seconds with nothing lost, and the same command
continues exactly: bitwise the same batches, losses and weights as an uninterrupted run, and the
same learning curve (no validation missing, none twice)."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_run
from pretraining.callbacks.preemption import Preemption
from pretraining.checkpoint import saved_checkpoints
from pretraining.slurm import EarlyNotice, leave_the_notice_alone, requeue_on_early_notice
from pretraining.train import train
from test_resume import (
    DDP,
    RESUMABLE,
    TEST_ENV,
    assert_same_training,
    fake_slurm,
    pretrain,
    pretrain_command,
    run_dir,
)

PHASES = [
    "setup",
    "validation_before_training",
    "save",
    "validation_in_training",
    "training",
    "final_validation",
    "report",
]
# Validation after steps 4 and 8 and after the last, 10; checkpoints at 4, 8 and 10.
# Validation in several batches (of the global batch, 4): a signal in a validation's first batch is seen
# inside that validation.
OVERRIDES = [
    *RESUMABLE,
    "trainer.max_steps=10",
    "trainer.val_check_interval=4",
    "data.micro_batch_size=null",
    "data.val_size=32",
]


def run_until_signalled(log_dir: Path, run: str, overrides: list[str]) -> tuple[int, float, str]:
    """Run `pretrain` once: its exit status, the time it ended, and its output."""
    command = pretrain_command(log_dir, run, overrides)
    process = subprocess.run(command, env=TEST_ENV, capture_output=True, text=True, timeout=180)
    return process.returncode, time.time(), process.stdout + process.stderr


def signal_in(markers: Path, phases: str) -> list[str]:
    """Overrides that send SIGTERM once in each of `phases` (all when empty), see `kill.SignalInEveryPhase`."""
    chosen = [f"+callbacks.signal.phases={phases}"] if phases else []
    return [
        "+callbacks.signal._target_=kill.SignalInEveryPhase",
        f"+callbacks.signal.markers={markers}",
        "+callbacks.signal.max_steps=10",
        *chosen,
    ]


def signalled_phases(markers: Path) -> set[str]:
    return {path.name for path in markers.iterdir()} if markers.is_dir() else set()


def validation_rows(log_dir: Path, run: str) -> list[tuple[str, str]]:
    with (run_dir(log_dir, run) / "csv" / "metrics.csv").open() as file:
        return [(row["step"], row["val/loss"]) for row in csv.DictReader(file) if row.get("val/loss")]


@pytest.mark.slow  # 91 s: nine runs; a signal in validation and at step boundaries stay in the default suite
def test_a_sigterm_in_every_phase_ends_the_run_and_it_continues_exactly(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *OVERRIDES, f"data.dir={shard_dir}"]
    markers = tmp_path / "signalled"
    signalled = [*overrides, *signal_in(markers, "")]
    while len(signalled_phases(markers)) < len(PHASES):
        before = signalled_phases(markers)
        status, ended, output = run_until_signalled(tmp_path, "signalled", signalled)
        # One phase a run, or two: a signal in a validation in training saves that step, a save signalled too.
        phases = signalled_phases(markers) - before
        assert phases, f"no signal in {set(PHASES) - before}; the run ended with {status}:\n{output[-3000:]}"
        # Killed by the signal's default action where nothing runs yet (or any more), else stopped by us.
        assert status in (-signal.SIGTERM, 128 + signal.SIGTERM), f"{phases}: exit {status}\n{output[-3000:]}"
        assert all(ended - float((markers / phase).read_text()) < 10 for phase in phases), phases
        assert "Traceback" not in output, output[-3000:]
    # The finished run, again: nothing runs (no validation row twice, no logger, so no second W&B run).
    status, _, output = run_until_signalled(tmp_path, "signalled", signalled)
    assert status == 0 and "the run is complete" in output and "Validation" not in output, output[-3000:]
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "signalled", 10)
    assert validation_rows(tmp_path, "signalled") == validation_rows(tmp_path, "reference")
    assert len(validation_rows(tmp_path, "reference")) == 4  # before training, after steps 4, 8 and 10


@pytest.mark.slow  # three runs; the signal tests of tests/test_resume.py stay in the fast suite
def test_a_validation_at_a_step_not_saved_yet_saves_it_before_stopping(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *OVERRIDES, "callbacks.checkpoint.every_n_steps=8", f"data.dir={shard_dir}"]
    signalled = [*overrides, *signal_in(tmp_path / "signalled", "[validation_in_training]")]
    status, _, output = run_until_signalled(tmp_path, "signalled", signalled)
    assert status == 128 + signal.SIGTERM, output[-3000:]
    assert [step for step, _ in saved_checkpoints(run_dir(tmp_path, "signalled") / "checkpoints")] == [4]
    assert run_until_signalled(tmp_path, "signalled", signalled)[0] == 0
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "signalled", 10)
    assert validation_rows(tmp_path, "signalled") == validation_rows(tmp_path, "reference")


def test_a_signal_while_the_trainer_makes_its_loaders_is_obeyed(compose_train, tmp_path: Path) -> None:
    """Lightning installs its handlers just before a stage runs; its SIGTERM path ended such a run with
    status 0 and nothing saved."""
    with pytest.raises(SystemExit) as stopped:
        train(compose_train("data._target_=kill.SignalingDataModule", "validate_before_training=false"))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert [step for step, _ in saved_checkpoints(tmp_path / "checkpoints")] == [1]


@pytest.mark.slow  # about a minute: two processes per run
def test_a_sigterm_to_one_rank_in_training_or_validation_stops_every_rank(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), *OVERRIDES, *DDP, f"data.dir={shard_dir}"]
    markers = tmp_path / "signalled"
    signalled = [*overrides, *signal_in(markers, "[validation_in_training,training]"), "+callbacks.signal.rank=1"]
    for phase in ("validation_in_training", "training"):
        status, ended, output = run_until_signalled(tmp_path, "signalled", signalled)
        assert (markers / phase).exists(), f"no signal in {phase}; the run ended with {status}:\n{output[-3000:]}"
        assert status == 128 + signal.SIGTERM, f"{phase}: exit {status}\n{output[-3000:]}"
        assert ended - float((markers / phase).read_text()) < 10, phase
    assert run_until_signalled(tmp_path, "signalled", signalled)[0] == 0
    assert pretrain(tmp_path, "reference", overrides) == 0
    assert_same_training(tmp_path, "reference", "signalled", 10)
    assert validation_rows(tmp_path, "signalled") == validation_rows(tmp_path, "reference")


@pytest.mark.slow  # 13 s: a real run with two workers
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_loader_workers_end_with_a_main_process_killed_mid_epoch(tmp_path: Path, shard_dir: Path) -> None:
    """A worker with a batch still to send (each batch here is larger than a pipe holds) stayed blocked
    writing it for good, ignoring SIGTERM: the main process alone is killed, its workers must follow."""
    overrides = [*tiny_run("clm_tiny"), f"data.dir={shard_dir}", "data.num_workers=2", "data.global_batch_size=64"]
    overrides += ["validate_before_training=false"]
    kill = ["+callbacks.kill._target_=kill.KillAt", "+callbacks.kill.batch=3", "+callbacks.kill.group=false"]
    command = pretrain_command(tmp_path, "killed", [*overrides, *kill])
    with (tmp_path / "stderr").open("w") as stderr:  # not a pipe: the workers hold it open
        process = subprocess.Popen(command, env=TEST_ENV, start_new_session=True, stderr=stderr)
    assert process.wait(timeout=180) == -signal.SIGKILL, (tmp_path / "stderr").read_text()[-3000:]
    for _ in range(100):  # 10 s: the kernel's SIGKILL takes a moment, torch's watch on a waiting worker 5 s
        if not living_in_group(process.pid):
            break
        time.sleep(0.1)
    left = living_in_group(process.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} DataLoader workers outlived the main process"


def living_in_group(group: int) -> list[int]:
    """The processes of a process group that are alive (not zombies)."""
    living = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except OSError:  # it ended
            continue
        if int(process_group) == group and state != "Z":
            living.append(int(stat.parent.name))
    return living


# --- SLURM's notice outside training ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variables", "requeued"),
    [({}, "requeue 4242\n"), ({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, "requeue 7_3\n")],
    ids=["job", "array-task"],
)
def test_the_notice_outside_training_requeues_the_job_and_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], requeued: str
) -> None:
    """In a process of its own, where an exception raised in the handler could be caught (Hydra composes the config
    once inside `except Exception`, and OmegaConf's cleanup can turn an exception raised at any line into an
    AttributeError): a SystemExit was lost there, about one start-up in 50, and the requeued job went on training."""
    log = fake_slurm(tmp_path, monkeypatch, **variables)
    code = (
        "import os, signal, time\nfrom pretraining.slurm import requeue_on_early_notice\nrequeue_on_early_notice()\n"
        "try:\n    os.kill(os.getpid(), signal.SIGUSR1)\n    time.sleep(5)\nexcept BaseException:\n    pass\n"
        "print('went on')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGUSR1 and "went on" not in done.stdout, done.stdout + done.stderr
    assert log.read_text() == requeued
    assert done.stderr == f"SIGUSR1 received outside training: requeued SLURM job {requeued.split()[1]}\n"


def test_another_task_goes_on_with_the_notice_noted_for_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exiting, it would have `srun --kill-on-bad-exit` end the first task before that one's requeue."""
    log = fake_slurm(tmp_path, monkeypatch, SLURM_PROCID="1")
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    preemption = Preemption()
    try:
        requeue_on_early_notice()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert EarlyNotice.received and not log.exists()
        preemption.install_handlers()  # as training's stage begins: the notice is its
        assert preemption.received == signal.SIGUSR1 and not EarlyNotice.received
    finally:
        preemption.restore_handlers()
        signal.signal(signal.SIGUSR1, before)
        EarlyNotice.received = False


def test_a_handler_someone_installed_for_the_notice_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitit's, in a sweep's job: it requeues the job outside training itself. A job with
    `callbacks.preemption.requeue=false` leaves the notice's default action."""
    fake_slurm(tmp_path, monkeypatch)
    theirs = signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        mine = signal.getsignal(signal.SIGUSR1)
        requeue_on_early_notice()
        assert signal.getsignal(signal.SIGUSR1) is mine
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        requeue_on_early_notice()
        leave_the_notice_alone()
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, theirs)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_the_notice_during_start_up_requeues_a_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_dir: Path
) -> None:
    """SLURM's notice can come before training begins (a short --time): the notice's default action ended the job,
    unrequeued, with exit 138."""
    log = fake_slurm(tmp_path, monkeypatch)
    environment = {**TEST_ENV, **{name: os.environ[name] for name in ("PATH", "SLURM_JOB_ID")}}
    command = pretrain_command(tmp_path, "early", [*tiny_run("clm_tiny"), f"data.dir={shard_dir}"])
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while process.poll() is None and not catches(process.pid, signal.SIGUSR1) and time.time() < deadline:
        time.sleep(0.05)
    torch_loaded = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
    os.kill(process.pid, signal.SIGUSR1)  # as soon as `pretrain` has its handler
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGUSR1, output[-3000:]
    assert not torch_loaded, "the handler came after torch loaded: a notice in the seconds before ended the job"
    assert log.read_text() == "requeue 4242\n"
    assert "SIGUSR1 received outside training: requeued SLURM job 4242" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not (run_dir(tmp_path, "early") / "checkpoints").exists()  # stopped before training: nothing to save


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)
