"""Running one Hydra job as one distributed job, whoever starts its processes: Lightning's DDP launcher starts the
other ranks by running the command again (`rank_command` gives them the job's config and directory); torchrun and
SLURM start every rank themselves. `distributed_job` wraps each job, so a multirun's next job starts its own ranks
and process group instead of inheriting the last one's."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from hydra.conf import HydraConf
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path
from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, ListConfig

from pretraining.data.loader import PR_SET_PDEATHSIG
from pretraining.errors import ConfigError
from pretraining.internals import start_ranks_with

# Set by Lightning's launcher in the starting process; left there, they tell a multirun's next job its ranks exist.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Variables that are 0 or unset only in the process of global rank zero, whichever launcher started it.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK")
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")


@contextmanager
def distributed_job() -> Iterator[None]:
    """One Hydra job as a distributed job of its own: extra ranks run its config in its directory, only rank zero
    writes the log file, and its process group and launcher variables go on the way out."""
    start_ranks_with(rank_command)
    end_with_torchrun()
    with log_file_on_rank_zero(), own_process_group():
        yield


def end_with_torchrun() -> None:
    """Have the kernel kill a rank that torchrun started when torchrun dies: it starts each rank in a session of its
    own, so a torchrun killed by SIGKILL (which it cannot pass on) left its ranks training, unwatched, in the run's
    directory. Linux only (prctl); a rank dying so is a node failure, which resume is made for."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextmanager
def own_process_group() -> Iterator[None]:
    """Destroy the process group on the way out, and restore the launcher variables."""
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def log_file_on_rank_zero() -> Iterator[None]:
    """The run's log file (Hydra's handler) gets rank zero's lines, Lightning's included; other ranks log to their
    console only."""
    root = logging.getLogger()
    files = [handler for handler in root.handlers if isinstance(handler, logging.FileHandler)]
    if not is_rank_zero_process():
        for handler in files:
            root.removeHandler(handler)
            handler.close()
        files = []
    # Lightning's loggers do not propagate to the root logger when it had no handlers at import.
    isolated = [logger for logger in map(logging.getLogger, LIGHTNING_LOGGERS) if not logger.propagate]
    for logger, handler in itertools.product(isolated, files):
        logger.addHandler(handler)
    try:
        yield
    finally:  # Hydra gives the next job of a multirun its own file
        for logger, handler in itertools.product(isolated, files):
            logger.removeHandler(handler)


def rank_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory for local rank `local_rank`: the job's program, config and overrides as a
    single run (no `-m`) in its output directory, whose records are rank zero's (`job_status.RecordJobStatus`).
    Lightning's own repeats `sys.argv`, a whole sweep in a multirun (`pretraining.internals.start_ranks_with`)."""
    hydra = HydraConfig.get()
    overrides = [o for o in hydra.overrides.hydra if not o.startswith("hydra.mode=")]
    output_dir = hydra_quote(hydra.runtime.output_dir)
    command = [*program(), *config_flags(hydra), *overrides, *hydra.overrides.task]
    command += [f"hydra.run.dir={output_dir}", "hydra.output_subdir=null"]  # the job's records are rank zero's
    return command, get_original_cwd()


def program() -> list[str]:
    """How this process was started: `python -m <module>` or `python <script>`."""
    import __main__

    if __main__.__spec__ is None:  # a script, the `pretrain` console script included
        return [sys.executable, to_absolute_path(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def config_flags(hydra: HydraConf) -> list[str]:
    """The flags that choose the job's primary config and config directories."""
    flags = ["--config-name", str(hydra.job.config_name)]
    for source in hydra.runtime.config_sources:
        location = source.path if source.schema == "file" else f"{source.schema}://{source.path}"
        if source.provider == "main":
            flags += ["--config-path", location]
        elif source.provider == "command-line":
            flags += ["--config-dir", location]
    return flags


def hydra_quote(value: str) -> str:
    """`value` as one quoted Hydra override value (a path may hold `,`, `=` or spaces), escaping quotes and the
    backslashes before a quote or the end."""
    return "'" + re.sub(r"(\\*)('|$)", lambda m: 2 * m[1] + ("\\'" if m[2] else ""), value) + "'"


def is_rank_zero_process() -> bool:
    """Whether this is global rank zero, from its launcher's environment variables: known before the trainer exists."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


# The accelerators configs/trainer/ presets name; `auto` takes the best this machine has.
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_devices(trainer: DictConfig) -> None:
    """Stop before any work, naming the fix, on devices that are not a count, indices or all, an accelerator the
    template does not run on, or GPUs this node lacks."""
    devices = trainer.get("devices", "auto")
    wanted = requested_gpus(devices)
    accelerator = trainer.get("accelerator", "auto")
    if not isinstance(accelerator, str):  # an Accelerator of your own (a node with _target_)
        return
    if accelerator not in ACCELERATORS:
        present = (("gpu", torch.cuda.is_available()), ("mps", torch.backends.mps.is_available()), ("cpu", True))
        here = [name for name, available in present if available]  # the best first
        raise ConfigError(
            f"trainer.accelerator={accelerator} is not one this template runs on; this machine has "
            f"{', '.join(here)}: set trainer.accelerator={here[0]} (or auto: the best of them), or pass trainer=cpu"
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "trainer.accelerator=mps needs an Apple-silicon Mac and a torch built with MPS: use trainer=cpu here"
        )
    if accelerator not in ("gpu", "cuda"):
        return
    available = torch.cuda.device_count()
    if not available:
        build = " (this torch is a CPU-only build)" if torch.version.cuda is None else ""
        raise ConfigError(
            f"trainer.accelerator={accelerator}, but this machine has no CUDA GPU{build}: use trainer=cpu "
            "(or trainer=ddp_cpu for two processes), or run on a machine with a GPU"
        )
    if wanted and max(wanted) >= available:
        raise ConfigError(
            f"trainer.devices={devices} asks for GPU {max(wanted)} but this node has {available} "
            f"(0 to {available - 1}): set trainer.devices={available} or fewer (-1 or auto: all of them), "
            "and trainer.num_nodes for more"
        )


# Where a launcher starts every rank: its variables and options for the ranks per node and the nodes, and the launch
# script that passes the nodes on.
LAUNCHERS = {
    "SLURM": ("SLURM_NTASKS_PER_NODE", "--ntasks-per-node", "SLURM_NNODES", "--nodes", "scripts/launch_slurm.sh"),
    "torchrun": ("LOCAL_WORLD_SIZE", "--nproc-per-node", "GROUP_WORLD_SIZE", "--nnodes", "scripts/launch_torchrun.sh"),
}


def check_launcher_ranks(trainer: DictConfig) -> None:
    """Where SLURM or torchrun starts the ranks, stop before any work if the devices or nodes differ from theirs:
    each process is one rank and Lightning starts none (Lightning's own error came after the data and model were
    built, and named neither key nor fix)."""
    devices, accelerator = trainer.get("devices", "auto"), trainer.get("accelerator", "auto")
    # torchrun first, as Lightning: torchrun can run inside a SLURM job, and then starts the ranks itself.
    launcher = "torchrun" if TorchElasticEnvironment.detect() else "SLURM" if SLURMEnvironment.detect() else None
    if launcher is None or not isinstance(accelerator, str):
        return
    tasks_variable, tasks_option, nodes_variable, nodes_option, script = LAUNCHERS[launcher]
    ntasks = os.environ.get("SLURM_NTASKS", "")
    if launcher == "SLURM" and "SLURM_STEP_ID" not in os.environ and ntasks.isdigit() and int(ntasks) > 1:
        raise ConfigError(
            f"pretrain runs in the batch script of a SLURM job of {ntasks} tasks, not in its tasks: start it with "
            f"srun, which runs one rank per task ({script} does); alone it would wait for the other ranks until the "
            "process group's timeout"
        )
    wanted = requested_gpus(devices)
    gpus = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    per_node = len(wanted) if wanted else torch.cuda.device_count() if gpus else None  # CPU "all": Lightning's
    tasks, nodes = os.environ.get(tasks_variable, ""), os.environ.get(nodes_variable, "")
    if tasks.isdigit() and per_node is not None and per_node != int(tasks):
        raise ConfigError(
            f"trainer.devices={devices} runs {per_node} rank(s) per node, but {launcher} starts "
            f"{tasks_option}={tasks}: each of its processes is one rank, so pass trainer.devices={tasks}, or start "
            f"{tasks_option}={per_node}"
        )
    num_nodes = trainer.get("num_nodes", 1)
    if nodes.isdigit() and num_nodes != int(nodes):
        raise ConfigError(
            f"trainer.num_nodes={num_nodes}, but {launcher} runs {nodes_option}={nodes}: pass "
            f"trainer.num_nodes={nodes} ({script} does)"
        )


def requested_gpus(devices: Any) -> list[int] | None:
    """The device indices `devices` asks for (`4`: 0 to 3; `[1, 3]` or `"1,3"`: those), None for all; anything else
    is refused naming the key, which Lightning's error would not."""
    text = str(devices).strip()
    try:
        if isinstance(devices, ListConfig | list | tuple):
            wanted = [int(index) for index in devices]
        elif text in ("auto", "-1"):
            return None
        elif "," in text:
            wanted = [int(index) for index in text.split(",") if index.strip()]
        else:
            wanted = list(range(int(text)))
    except ValueError:
        wanted = []
    if not wanted or min(wanted) < 0:
        raise ConfigError(
            f"trainer.devices={devices!r} is not a number of devices, a list of device indices or all of them: "
            "set trainer.devices=1 (or 2, [0,2], -1 or auto: all of them)"
        )
    return wanted
