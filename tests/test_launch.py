"""Trainer presets; one directory per run (or multirun job) that every rank shares, whoever starts the
ranks (Lightning's launcher, torchrun); GPU requests the machine cannot meet; the SLURM launcher config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from omegaconf import OmegaConf

from conftest import free_port, tiny_run
from pretraining.config import CONFIG_DIR, PROJECT_ROOT
from pretraining.errors import ConfigError
from pretraining.instantiate import build
from pretraining.launch import check_devices, check_launcher_ranks, hydra_quote
from pretraining.models.llama import DecoderLayer
from pretraining.models.transformer import Block
from pretraining.train import train

TESTS = Path(__file__).parent
TRAINER_PRESETS = sorted(path.stem for path in (CONFIG_DIR / "trainer").glob("*.yaml"))
# Two ranks on the CPU, each logging its batches and recording its process (RecordProcess below).
SHORT_DDP = [
    *tiny_run("clm_tiny"),
    "trainer=ddp_cpu",
    "trainer.max_steps=3",
    "validate_before_training=false",
    "callbacks=[default,batch_log]",
    "~callbacks.text_sample",
    "+callbacks.record._target_=test_launch.RecordProcess",
]


class RecordProcess(Callback):
    """Writes `<run dir>/processes/rank<N>.json`: this process's id, command line and run directory."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {"pid": os.getpid(), "argv": sys.argv, "run_dir": trainer.default_root_dir}
        path = Path(trainer.default_root_dir) / "processes" / f"rank{trainer.global_rank}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record))


def processes(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted((run_dir / "processes").glob("*.json"))}


def batch_counts(run_dir: Path) -> dict[str, int]:
    return {path.stem: len(path.read_text().splitlines()) for path in sorted((run_dir / "batches").glob("*.jsonl"))}


def run_command(command: list[str], cwd: Path, **env: str) -> str:
    """Run `command` in `cwd`, in its own process group, with the tests importable (for RecordProcess); its output."""
    pythonpath = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "WANDB_MODE": "offline", **env}
    process = subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True, stdout=PIPE, stderr=PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # every rank, not only the first
        raise
    assert process.returncode == 0, stderr[-3000:]
    return stdout + stderr


def pretrain(tmp_path: Path, *args: str) -> str:
    """The `pretrain` console script, started from an empty directory that must stay empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    output = run_command([str(Path(sys.executable).parent / "pretrain"), *args], cwd)
    assert not list(cwd.iterdir()), "the run wrote outside its run directory"
    return output


# --- presets ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", TRAINER_PRESETS)
def test_every_trainer_preset_composes_and_the_cpu_ones_build(compose_train, preset: str) -> None:
    trainer_cfg = compose_train(f"trainer={preset}").trainer
    if trainer_cfg.accelerator == "gpu":  # in bf16: Lightning's autocast, or FSDP2's own policy
        assert trainer_cfg.precision == "bf16-mixed" or trainer_cfg.strategy.mixed_precision == "bf16"
        return
    if trainer_cfg.accelerator == "mps":  # builds only on a Mac: see test_the_mps_preset_elsewhere_stops...
        return
    trainer = build(trainer_cfg, logger=False)
    assert isinstance(trainer.accelerator, CPUAccelerator)
    assert trainer.world_size == trainer_cfg.devices * trainer_cfg.get("num_nodes", 1)


def test_fsdp1_makes_each_layer_of_either_backbone_a_unit(compose_train) -> None:
    strategy = build(compose_train("trainer=fsdp1").trainer.strategy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block, DecoderLayer}


def test_ddp_takes_every_gpu_of_a_node_and_any_number_of_nodes(compose_train) -> None:
    trainer_cfg = compose_train("trainer=ddp", "trainer.num_nodes=4").trainer
    assert (trainer_cfg.strategy, trainer_cfg.devices, trainer_cfg.num_nodes) == ("ddp", "auto", 4)


# --- GPUs the machine does not have -------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("preset", ["gpu", "ddp", "fsdp1"])
def test_a_gpu_preset_without_a_gpu_stops_before_any_work(compose_train, tmp_path: Path, preset: str) -> None:
    with pytest.raises(ConfigError, match=r"trainer.accelerator=gpu, but this machine has no CUDA GPU.*trainer=cpu"):
        train(compose_train(f"trainer={preset}"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without Apple's GPU")
def test_the_mps_preset_elsewhere_stops_before_any_work(compose_train, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.accelerator=mps needs an Apple-silicon Mac .* use trainer=cpu"):
        train(compose_train("trainer=mps"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("devices", "gpu"), [("4", 3), ("[0,2]", 2), ("'0,5'", 5)])
def test_more_gpus_than_the_node_has_are_refused(compose_train, monkeypatch, devices: str, gpu: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = rf"asks for GPU {gpu} but this node has 2 \(0 to 1\): set trainer.devices=2 or fewer"
    with pytest.raises(ConfigError, match=message):
        check_devices(compose_train("trainer=ddp", f"trainer.devices={devices}").trainer)
    for fits in ("2", "auto", "-1", "[1]"):
        check_devices(compose_train("trainer=ddp", f"trainer.devices={fits}").trainer)


def slurm_tasks(monkeypatch: pytest.MonkeyPatch, per_node: int, nodes: int) -> None:
    """The variables of a task that `srun` started in a job of `nodes` nodes x `per_node` tasks."""
    variables = {"SLURM_NTASKS": per_node * nodes, "SLURM_NTASKS_PER_NODE": per_node, "SLURM_NNODES": nodes}
    for name, value in {**variables, "SLURM_JOB_NAME": "pretrain", "SLURM_JOB_ID": 7, "SLURM_STEP_ID": 0}.items():
        monkeypatch.setenv(name, str(value))


def test_devices_or_nodes_unlike_the_slurm_jobs_are_refused_before_any_work(
    compose_train, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 nodes x 1 task with ddp_cpu's devices=2: Lightning refused it only after the data and model were built."""
    slurm_tasks(monkeypatch, per_node=1, nodes=2)
    with pytest.raises(
        ConfigError,
        match=r"trainer.devices=2 runs 2 rank\(s\) per node, but SLURM starts "
        r"--ntasks-per-node=1: each of its processes is one rank, so pass trainer.devices=1",
    ):
        train(compose_train("trainer=ddp_cpu", "++trainer.num_nodes=2"))
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=1, but SLURM runs --nodes=2: pass trainer.num_nodes=2"):
        train(compose_train("trainer=ddp_cpu", "trainer.devices=1"))
    assert not (tmp_path / "checkpoints").exists()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    slurm_tasks(monkeypatch, per_node=4, nodes=2)
    with pytest.raises(ConfigError, match=r"trainer.devices=auto runs 8 rank\(s\) per node"):
        check_launcher_ranks(compose_train("trainer=ddp", "++trainer.num_nodes=2").trainer)
    check_launcher_ranks(compose_train("trainer=ddp", "++trainer.num_nodes=2", "trainer.devices=4").trainer)
    monkeypatch.delenv("SLURM_STEP_ID")  # in the job's batch script, not in a task srun started
    with pytest.raises(ConfigError, match=r"runs in the batch script of a SLURM job of 8 tasks, not in its tasks"):
        check_launcher_ranks(compose_train("trainer=ddp", "++trainer.num_nodes=2", "trainer.devices=4").trainer)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's way to run a launcher of one's own in SLURM
    check_launcher_ranks(compose_train("trainer=ddp", "++trainer.num_nodes=1").trainer)
    # torchrun's: 2 nodes x 1 process
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"runs 2 rank\(s\) per node, but torchrun starts --nproc-per-node=1"):
        check_launcher_ranks(compose_train("trainer=ddp_cpu", "++trainer.num_nodes=2").trainer)
    check_launcher_ranks(compose_train("trainer=ddp_cpu", "++trainer.num_nodes=2", "trainer.devices=1").trainer)
    # torchrun inside a SLURM job of one task per node: torchrun's ranks, as Lightning sees them
    slurm_tasks(monkeypatch, per_node=1, nodes=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launcher_ranks(compose_train("trainer=ddp_cpu", "++trainer.num_nodes=2").trainer)


@pytest.mark.parametrize("devices", ["banana", "0", "-2", "1.5", "[]", "[-1]"])
def test_devices_that_are_no_count_indices_or_all_are_refused_naming_the_key(compose_train, devices: str) -> None:
    with pytest.raises(ConfigError, match=r"^trainer\.devices=.* is not a number of devices, a list of device indices"):
        check_devices(compose_train("trainer=cpu", f"trainer.devices={devices}").trainer)


@pytest.mark.parametrize("accelerator", ["tpu", "hpu", "xla"])
def test_an_accelerator_the_template_does_not_run_on_is_refused_naming_those_here(
    compose_train, monkeypatch, accelerator: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    message = rf"trainer\.accelerator={accelerator} is not one this template runs on; this machine has gpu, .*cpu"
    with pytest.raises(ConfigError, match=message):
        check_devices(compose_train(f"trainer.accelerator={accelerator}").trainer)


def test_paths_are_quoted_for_hydra() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for path in ["/runs/a b", "/runs/lr=1e-3,seed=1", "/runs/it's", "/runs/back\\slash", "/runs/end\\"]:
        assert parser.parse_override(f"hydra.run.dir={hydra_quote(path)}").value() == path


# --- one run directory, whoever starts the ranks ------------------------------------------------------------


@pytest.mark.distributed
def test_ddp_run_has_one_directory_that_the_child_rank_uses(tmp_path: Path, small_shards: Path) -> None:
    logs = tmp_path / "logs"
    # quiet=false: Lightning's "Initializing distributed: GLOBAL_RANK: N" lines tell whose lines a log holds
    pretrain(tmp_path, *SHORT_DDP, f"data.dir={small_shards}", f"paths.log_dir={logs}", "quiet=false")
    (run_dir,) = (logs / "train" / "runs").iterdir()
    assert [path.parent for path in logs.rglob(".hydra")] == [run_dir]  # one config, written by rank zero
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert batch_counts(run_dir) == {"rank0": 3, "rank1": 3}
    ranks = processes(run_dir)
    assert {rank["run_dir"] for rank in ranks.values()} == {str(run_dir)}
    log = (run_dir / "train.log").read_text()  # rank zero's lines only, Lightning's included
    assert "GLOBAL_RANK: 0" in log and "GLOBAL_RANK: 1" not in log


@pytest.mark.distributed
def test_multirun_jobs_each_start_their_own_ranks(tmp_path: Path, small_shards: Path) -> None:
    logs = tmp_path / "logs"
    pretrain(tmp_path, "-m", *SHORT_DDP, f"data.dir={small_shards}", f"paths.log_dir={logs}", "seed=1,2", "quiet=false")
    (sweep,) = (logs / "train").iterdir()
    (sweep_dir,) = sweep.iterdir()
    jobs_and_report = ["0", "1", "multirun.yaml", "plots", "report.csv", "report.md"]
    assert sweep.name == "multiruns" and sorted(p.name for p in sweep_dir.iterdir()) == jobs_and_report
    jobs = [processes(sweep_dir / job) for job in ("0", "1")]
    for job, (ranks, seed) in enumerate(zip(jobs, ("seed=1", "seed=2"), strict=True)):
        job_dir = sweep_dir / str(job)
        assert (job_dir / "checkpoints" / "last.ckpt").is_file()
        assert batch_counts(job_dir) == {"rank0": 3, "rank1": 3}
        status = json.loads((job_dir / "status.json").read_text())  # written once, by rank zero
        assert status["status"] == "completed" and status["pid"] == ranks["rank0"]["pid"]
        assert {rank["run_dir"] for rank in ranks.values()} == {str(job_dir)}
        log = (job_dir / "train.log").read_text()  # each job's own log file, rank zero's lines only
        assert "GLOBAL_RANK: 0" in log and "GLOBAL_RANK: 1" not in log
        child = ranks["rank1"]["argv"]  # the job's own overrides, as a single run
        assert "-m" not in child and seed in child and "seed=1,2" not in child
    assert jobs[0]["rank0"]["pid"] == jobs[1]["rank0"]["pid"]  # one process runs the sweep...
    assert jobs[0]["rank1"]["pid"] != jobs[1]["rank1"]["pid"]  # ...and each job starts its own second rank


@pytest.mark.distributed
def test_torchrun_starts_every_rank_and_lightning_none(tmp_path: Path, small_shards: Path) -> None:
    logs = tmp_path / "logs"
    overrides = [o for o in SHORT_DDP if o != "trainer=ddp_cpu"]
    script = str(PROJECT_ROOT / "scripts" / "launch_torchrun.sh")
    env = {"TRAINER": "ddp_cpu", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    run_command([script, *overrides, f"data.dir={small_shards}", f"paths.log_dir={logs}"], tmp_path, **env)
    (run_dir,) = (logs / "train" / "runs").iterdir()
    assert batch_counts(run_dir) == {"rank0": 3, "rank1": 3}
    ranks = processes(run_dir)
    assert list(ranks) == ["rank0", "rank1"]
    assert ranks["rank0"]["argv"] == ranks["rank1"]["argv"]  # both from torchrun, none from Lightning


# --- SLURM sweeps -------------------------------------------------------------------------------------------


def test_slurm_launcher_config_composes(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")
    overrides = ["hydra/launcher=slurm", "trainer=ddp", "++trainer.num_nodes=2", f"paths.log_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher["nodes"], launcher["tasks_per_node"]) == (2, launcher["gpus_per_node"])
    assert launcher["additional_parameters"] == {"signal": "USR1@120", "requeue": True}
    assert launcher["setup"] == ["export SUBMITIT_PREEMPT_SIGNAL=USR1", "export SLURM_KILL_BAD_EXIT=1"]
