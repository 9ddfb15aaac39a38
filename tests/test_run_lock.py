"""One job at a time in a run directory (`pretraining.run_lock`), with real processes: a second job is
refused at once naming the holder, a holder killed by SIGKILL never blocks the next, a DDP job is one
holder, and a command refused at start-up leaves no run directory behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import DictConfig, OmegaConf

from conftest import tiny_run
from pretraining.checkpoint import saved_checkpoints
from pretraining.config import CONFIG_DIR, check_job_directory, refuse_unless
from pretraining.errors import ConfigError, MissingFileError, RunLockedError
from pretraining.resume import start_over
from pretraining.run_lock import HELD, LOCK_FILE, holder, own_run_directory
from pretraining.stored import load_checkpoint

TESTS = Path(__file__).parent
PRETRAIN = str(Path(sys.executable).parent / "pretrain")
# Holds the lock on argv[1] until killed; prints "held" once it has it.
HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from pretraining.run_lock import own_run_directory\n"
    "with own_run_directory(Path(sys.argv[1])):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(600)\n"
)
# Takes the lock on argv[1] and lets it go: exit 0, or 3 if refused.
TAKE = (
    "import sys\n"
    "from pathlib import Path\n"
    "from pretraining.errors import RunLockedError\n"
    "from pretraining.run_lock import own_run_directory\n"
    "try:\n"
    "    with own_run_directory(Path(sys.argv[1])):\n"
    "        pass\n"
    "except RunLockedError:\n"
    "    sys.exit(3)\n"
)


class WaitFor(Callback):
    """Holds training after each batch until the file `path` exists (at most 5 minutes), and says so in
    `<path>.waiting`: a run that is still going while a test starts a second one."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        Path(f"{self.path}.waiting").touch()
        deadline = time.monotonic() + 300
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def hold(run_dir: Path) -> subprocess.Popen:
    """Another process that holds the lock on `run_dir` (until the test kills it)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def take_elsewhere(run_dir: Path) -> int:
    """Exit status of another process taking the lock on `run_dir`: 0 taken, 3 refused."""
    return subprocess.run([sys.executable, "-c", TAKE, str(run_dir)], timeout=60).returncode


# --- the lock ---------------------------------------------------------------------------------------------


def test_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_blocks_no_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder_process = hold(run_dir)
    try:
        record = holder(run_dir)
        assert record["pid"] == str(holder_process.pid) and record["host"] == socket.gethostname()
        with pytest.raises(RunLockedError) as refused, own_run_directory(run_dir):
            pytest.fail("two processes held one run directory")
        message = str(refused.value)
        for part in (str(run_dir), f"process {holder_process.pid}", socket.gethostname(), record["started"]):
            assert part in message
        assert "run_name=" in message and "Wait for it to finish" in message
        assert take_elsewhere(run_dir) == 3
    finally:
        kill(holder_process)
    # The lock file of the dead holder is still there, and blocks no one.
    assert (run_dir / LOCK_FILE).is_file()
    with own_run_directory(run_dir):
        assert holder(run_dir)["pid"] == str(os.getpid())
        assert take_elsewhere(run_dir) == 3
    assert take_elsewhere(run_dir) == 0  # released on the way out
    assert not HELD


def test_a_forked_child_of_a_killed_holder_blocks_no_one(tmp_path: Path) -> None:
    """A DataLoader worker (forked) can outlive its SIGKILLed main process for a few seconds."""
    forking = HOLD.replace(
        "    print('held'", "    child = __import__('os').fork()\n    if not child: time.sleep(60)\n    print('held'"
    )
    process = subprocess.Popen([sys.executable, "-c", forking, str(tmp_path)], stdout=PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    assert take_elsewhere(tmp_path) == 3
    kill(process)
    try:
        assert take_elsewhere(tmp_path) == 0  # the child still lives
    finally:
        subprocess.run(["pkill", "-KILL", "-f", forking.splitlines()[0]], check=False)


def test_starting_over_keeps_the_lock_in_place(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    with own_run_directory(tmp_path):
        start_over(tmp_path)  # resume=never moves the earlier outputs aside, not the lock this job holds
        assert not (tmp_path / "checkpoints").exists() and (tmp_path / LOCK_FILE).is_file()
        assert take_elsewhere(tmp_path) == 3


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    with own_run_directory(tmp_path) as outer, own_run_directory(tmp_path) as inner:
        assert inner is outer
    with own_run_directory(tmp_path):  # released by both
        assert take_elsewhere(tmp_path) == 3


def hydra_output(run_dir: Path) -> Path:
    """A run directory as Hydra leaves it before the job starts: config copies and the log file."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}\n")
    (run_dir / "train.log").write_text("")
    return run_dir


def test_a_refused_command_removes_only_a_directory_it_made_and_nothing_wrote_in(tmp_path: Path) -> None:
    made = hydra_output(tmp_path / "made")
    with pytest.raises(ConfigError), own_run_directory(made):
        (made / "status.json").write_text("{}")  # the job-status record of this command
        raise ConfigError("bad value")
    assert not made.exists()

    trained = hydra_output(tmp_path / "trained")  # an error after the run wrote something of its own
    with pytest.raises(ConfigError), own_run_directory(trained):
        (trained / "metrics.csv").write_text("step\n")
        raise ConfigError("bad value")
    assert (trained / "metrics.csv").is_file()

    earlier = hydra_output(tmp_path / "earlier")  # an earlier run's status record: not this command's directory
    (earlier / "status.json").write_text("{}")
    with pytest.raises(ConfigError), own_run_directory(earlier):
        raise ConfigError("bad value")
    assert (earlier / "status.json").is_file()

    job = hydra_output(tmp_path / "job")  # a multirun's job: its failure is a row of the sweep report
    with pytest.raises(ConfigError), own_run_directory(job, remove_if_refused=False):
        raise ConfigError("bad value")
    assert job.is_dir()

    other = hydra_output(tmp_path / "other")  # any other error keeps the directory, to look at
    with pytest.raises(RuntimeError), own_run_directory(other):
        raise RuntimeError("a bug")
    assert other.is_dir()


# --- the `pretrain` command -------------------------------------------------------------------------------


def start(*overrides: str) -> subprocess.Popen:
    """`pretrain` in its own process group, with the tests importable (for `WaitFor`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [PRETRAIN, *overrides], env=env, start_new_session=True, stdout=PIPE, stderr=PIPE, text=True
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, stderr


def run_dir(log_dir: Path, run: str) -> Path:
    return log_dir / "train" / "runs" / run


def files(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_a_command_on_a_directory_in_use_is_refused_at_once_and_writes_nothing_of_its_own(
    tmp_path: Path, shard_dir: Path
) -> None:
    directory = hydra_output(run_dir(tmp_path, "busy"))  # the config of the run in progress, as Hydra wrote it
    (directory / ".hydra" / "overrides.yaml").write_text("- model.optimizer.lr=0.003\n")
    holder_process = hold(directory)
    try:
        before = files(directory)  # the holder's record included
        returncode, stderr = finish(
            start(
                *tiny_run(),
                f"data.dir={shard_dir}",
                f"paths.log_dir={tmp_path}",
                "run_name=busy",
                "model.optimizer.lr=0.1",
            )
        )
        assert returncode != 0
        assert "Traceback" not in stderr, stderr
        assert f"The run directory {directory} is in use by process {holder_process.pid}" in stderr
        assert "run_name=<another name>" in stderr
        # Neither its config copies, nor a status record (running or failed), nor a log line: not one byte.
        assert files(directory) == before
    finally:
        kill(holder_process)


# A refusal before the job starts (max_steps) and one at set-up (n_head: the same path, in the slow suite).
@pytest.mark.parametrize(
    "bad", ["trainer.max_steps=0", pytest.param("model.backbone.n_head=3", marks=pytest.mark.slow)]
)
def test_a_refused_command_leaves_no_run_directory(tmp_path: Path, shard_dir: Path, bad: str) -> None:
    returncode, stderr = finish(
        start(*tiny_run(), f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}", "run_name=bad", bad)
    )
    assert returncode != 0 and "Traceback" not in stderr, stderr
    assert not run_dir(tmp_path, "bad").exists()
    assert (tmp_path / "train" / "runs").is_dir()  # Hydra's parent directories may stay: they are shared


def final_weights(directory: Path) -> dict[str, torch.Tensor]:
    (_, newest), *_ = saved_checkpoints(directory / "checkpoints")
    return load_checkpoint(newest)["state_dict"]


def newest_step(directory: Path) -> int:
    return saved_checkpoints(directory / "checkpoints")[0][0]


def wait_for_lock(directory: Path, process: subprocess.Popen, release: Path, timeout: float = 120) -> None:
    """Until `process` holds the lock on `directory` and has trained its first batch (and writes no
    checkpoint: `WaitFor` holds it there until `release` exists)."""
    deadline = time.monotonic() + timeout
    while holder(directory).get("pid") != str(process.pid) or not Path(f"{release}.waiting").exists():
        assert process.poll() is None, finish(process)[1][-3000:]
        assert time.monotonic() < deadline, "the first command never took the lock"
        time.sleep(0.2)


def held_command(tmp_path: Path, shard_dir: Path, run: str, *more: str) -> list[str]:
    release = tmp_path / f"release-{run}"
    return [
        *tiny_run(),
        f"data.dir={shard_dir}",
        f"paths.log_dir={tmp_path}",
        "trainer.max_steps=4",
        "callbacks.checkpoint.every_n_steps=2",
        "trainer.val_check_interval=2",
        "~callbacks.text_sample",
        "+callbacks.wait._target_=test_run_lock.WaitFor",
        f"+callbacks.wait.path={release}",
        f"run_name={run}",
        *more,
    ]


@pytest.mark.slow
def test_two_identical_commands_at_once_one_trains_as_if_alone(tmp_path: Path, shard_dir: Path) -> None:
    (tmp_path / "release-solo").touch()
    solo, stderr = finish(start(*held_command(tmp_path, shard_dir, "solo")))
    assert solo == 0, stderr[-3000:]

    command = held_command(tmp_path, shard_dir, "twice")
    first = start(*command)
    directory = run_dir(tmp_path, "twice")
    wait_for_lock(directory, first, tmp_path / "release-twice")
    began = time.monotonic()
    returncode, stderr = finish(start(*command))
    assert returncode != 0 and "Traceback" not in stderr, stderr
    assert f"is in use by process {first.pid} on {socket.gethostname()}" in stderr
    assert time.monotonic() - began < 60  # refused at start-up, not after building anything
    assert first.poll() is None
    (tmp_path / "release-twice").touch()
    returncode, stderr = finish(first)
    assert returncode == 0, stderr[-3000:]

    expected, actual = final_weights(run_dir(tmp_path, "solo")), final_weights(directory)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected), "final weights differ"
    assert '"status": "completed"' in (directory / "status.json").read_text()


@pytest.mark.slow
def test_a_holder_killed_by_sigkill_does_not_block_the_same_command_again(tmp_path: Path, shard_dir: Path) -> None:
    command = held_command(tmp_path, shard_dir, "killed")
    first = start(*command)
    directory = run_dir(tmp_path, "killed")
    wait_for_lock(directory, first, tmp_path / "release-killed")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    (tmp_path / "release-killed").touch()
    returncode, stderr = finish(start(*command))
    assert returncode == 0, stderr[-3000:]
    assert newest_step(directory) == 4


@pytest.mark.distributed
@pytest.mark.slow
def test_a_ddp_job_is_one_holder_and_a_second_job_is_refused(tmp_path: Path, shard_dir: Path) -> None:
    command = held_command(tmp_path, shard_dir, "ddp", "trainer=ddp_cpu")
    first = start(*command)
    directory = run_dir(tmp_path, "ddp")
    wait_for_lock(
        directory, first, tmp_path / "release-ddp", timeout=240
    )  # both ranks are training: rank 1 took no lock of its own
    returncode, stderr = finish(start(*command))
    assert returncode != 0 and "Traceback" not in stderr, stderr
    assert f"is in use by process {first.pid}" in stderr
    assert first.poll() is None
    (tmp_path / "release-ddp").touch()
    returncode, stderr = finish(first)
    assert returncode == 0, stderr[-3000:]
    assert newest_step(directory) == 4


def sweep_job(job_dir: Path, *overrides: str, subdir: str = "same") -> Any:
    """A multirun job's config, as far as `check_job_directory` reads it."""
    hydra = {"runtime": {"output_dir": str(job_dir)}, "sweep": {"subdir": subdir}, "overrides": {"task": overrides}}
    return OmegaConf.create({"hydra": hydra})


def test_a_sweep_job_is_refused_a_directory_holding_another_jobs_run(tmp_path: Path) -> None:
    job_dir = tmp_path / "same"
    check_job_directory(sweep_job(job_dir, "model.optimizer.lr=0.001"))  # nothing recorded there yet
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text("- model.optimizer.lr=0.001\n- seed=1\n")
    check_job_directory(sweep_job(job_dir, "seed=1", "model.optimizer.lr=0.001", "quiet=false"))  # the same job
    with pytest.raises(
        ConfigError,
        match=r"^hydra\.sweep\.subdir=same: this job \(model\.optimizer\.lr=0\.002\) would write .*/same, which holds "
        r"the run of another job \(model\.optimizer\.lr=0\.001\): give each job its own directory",
    ):
        check_job_directory(sweep_job(job_dir, "model.optimizer.lr=0.002", "seed=1"))
    with pytest.raises(ConfigError, match=r"^hydra\.sweep\.subdir='\.\./x': a multirun's job directory is"):
        check_job_directory(sweep_job(job_dir, subdir="../x"))
    (job_dir / ".hydra" / "overrides.yaml").write_text("{not: [a list")
    with pytest.raises(ConfigError, match=r"overrides\.yaml is not a list of overrides, so its job cannot be told"):
        check_job_directory(sweep_job(job_dir, "model.optimizer.lr=0.001"))
    (job_dir / ".hydra" / "overrides.yaml").unlink()
    os.mkfifo(job_dir / ".hydra" / "overrides.yaml")  # refused, not read: it would block
    with pytest.raises(MissingFileError, match=r"overrides\.yaml is a named pipe, not a file"):
        check_job_directory(sweep_job(job_dir, "model.optimizer.lr=0.001"))


@pytest.mark.slow  # a two-job sweep, ~30 s
def test_a_sweep_whose_jobs_share_a_directory_stops_at_the_second(tmp_path: Path, shard_dir: Path) -> None:
    sweep = [*tiny_run(), f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}", "trainer.max_steps=2"]
    sweep += ["trainer.val_check_interval=2", "callbacks.checkpoint.every_n_steps=2", "~callbacks.text_sample"]
    returncode, stderr = finish(start("-m", *sweep, "model.optimizer.lr=0.001,0.002", "hydra.sweep.subdir=same"))
    assert returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    refusal = stderr.strip().splitlines()[-1]
    assert refusal.startswith("hydra.sweep.subdir=same: this job (model.optimizer.lr=0.002) would write"), refusal
    (job_dir,) = (tmp_path / "train" / "multiruns").glob("*/same")
    assert OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")[-1] == "model.optimizer.lr=0.001"  # job 1's, kept


def test_a_directory_check_that_cannot_run_names_the_key_checked_and_its_fix() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        config = compose("train", return_hydra_config=True)

    def unreadable(config: DictConfig) -> None:
        raise PermissionError(13, "Permission denied", "logs/sweep/0/.hydra/overrides.yaml")

    with pytest.raises(SystemExit, match=r"^hydra\.sweep\.subdir cannot be checked \(PermissionError: .*overrides"):
        refuse_unless(config, unreadable, "hydra.sweep.subdir", "hydra.sweep.subdir=<name>")
