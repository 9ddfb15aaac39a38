"""How many processes a config's Trainer runs on, known before it is built: the accumulation making the global batch
follows from it, and the Trainer takes that (and the validation interval, counted in micro-batches) in its
constructor. Worked out as Lightning does; `pretraining.run.build_trainer` stops a run whose Trainer disagrees."""

from __future__ import annotations

import pydoc
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from omegaconf import DictConfig, ListConfig, OmegaConf

# The launchers Lightning detects, in its order (torchrun first: it also runs inside SLURM jobs).
LAUNCHERS = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)
ACCELERATORS: dict[str, type[Accelerator]] = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator, "mps": MPSAccelerator}


def world_size(trainer: DictConfig, plugins: Sequence[Any]) -> int:
    """The Trainer's processes: one on one device of one node (single-device strategy); else a launcher's (a cluster
    environment in `plugins`, or the one detected); else nodes times devices per node."""
    nodes = int(trainer.get("num_nodes") or 1)
    devices = device_count(trainer.get("accelerator") or "auto", trainer.get("devices") or "auto")
    if nodes == 1 and devices <= 1 and trainer.get("strategy") in (None, "auto"):
        return 1
    given = [plugin for plugin in plugins if isinstance(plugin, ClusterEnvironment)]
    environment = given[0] if given else next((launcher() for launcher in LAUNCHERS if launcher.detect()), None)
    if environment is None or isinstance(environment, LightningEnvironment):  # Lightning starts the processes
        return nodes * devices
    return environment.world_size()


def device_count(accelerator: Any, devices: Any) -> int:
    """The devices of each node that `trainer.accelerator` and `trainer.devices` name."""
    kind = accelerator_class(accelerator)
    if isinstance(devices, ListConfig):
        devices = OmegaConf.to_object(devices)
    if devices == "auto":
        devices = kind.auto_device_count()
    return len(kind.get_parallel_devices(kind.parse_devices(devices)))


def accelerator_class(accelerator: Any) -> type[Accelerator]:
    """The accelerator class that `trainer.accelerator` names: "auto" and "gpu" as Lightning chooses."""
    if isinstance(accelerator, DictConfig):
        return pydoc.locate(accelerator.get("_target_"))  # type: ignore[return-value]
    if accelerator in ("auto", "gpu"):
        available = [kind for kind in (MPSAccelerator, CUDAAccelerator) if kind.is_available()]
        return available[0] if available else CPUAccelerator
    return ACCELERATORS[str(accelerator)]
