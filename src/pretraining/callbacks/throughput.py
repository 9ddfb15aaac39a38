"""Throughput, data wait, memory and MFU (model FLOP/s over the devices' peak), logged every few steps.

The model FLOPs are the objective's (`PretrainingObjective.batch_work`, from `Backbone.flops_per_token`,
recomputation not counted). Counts come from batch shapes on the host, the data wait from `WaitTimedLoader`,
and the clock is read (after a CUDA sync) only at logging steps, so measuring costs no per-step sync."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from pretraining.data.loader import WaitTimedLoader
from pretraining.objectives.base import BatchWork
from pretraining.plugins import fsdp2_strategy

# Dense peaks, checked before Lightning's table: its H200 entries are the 2:4-sparse ones, and miss some names.
DENSE_PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "h200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, "tfloat32": 494.7e12, torch.float32: 66.9e12},
}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak matmul FLOP/s in `dtype` (float32: TF32 where allowed); None where unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for fragment, peaks in DENSE_PEAK_FLOPS.items():
        if fragment in name:
            tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
            return peaks.get("tfloat32" if tf32 else dtype)
    available = get_available_flops(device, dtype)
    return None if available is None else float(available)


def compute_dtype(trainer: Trainer) -> torch.dtype:
    """The dtype the matmuls run in: the FSDP2 policy's, else the Trainer precision's."""
    fsdp2 = fsdp2_strategy(trainer.strategy)
    if fsdp2 is not None and fsdp2.policy.param_dtype is not None:
        return fsdp2.policy.param_dtype
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


def data_parallel_size(trainer: Trainer) -> int:
    """How many ranks train on batches of their own (tensor-parallel ranks share one)."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return strategy.device_mesh["data_parallel"].size()
    return trainer.world_size


def peak_host_memory_gb() -> float | None:
    """The peak resident memory of this process (not of its DataLoader workers), where the OS tells it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9  # bytes on macOS, KiB on Linux


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory so far: this process's resident memory and, on CUDA, the device's allocations."""
    metrics = {}
    host = peak_host_memory_gb()
    if host is not None:
        metrics["perf/peak_host_memory_gb"] = host
    if device.type == "cuda":
        metrics["perf/peak_device_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return metrics


def data_waited(trainer: Trainer) -> float | None:
    """Seconds the training loop has waited for batches so far, if its loader counts them."""
    loader = trainer.train_dataloader
    return loader.waited if isinstance(loader, WaitTimedLoader) else None


class Throughput(Callback):
    """At Lightning's logging steps, log `perf/tokens_per_s` and `perf/samples_per_s` (all data-parallel
    ranks, and `..._per_device`), `perf/step_time`, `perf/data_wait` (the share of it spent waiting for
    batches: near 1, add `data.num_workers`), `perf/mfu` where the peak is known, and peak memory.

    The clock starts after the first step (compilation, warm-up) and pauses during validation. `peak_flops`
    (per device) is for a device Lightning's table lacks; `clock` is for tests. Not `ThroughputMonitor`: it
    syncs CUDA every batch, counts micro-batches as steps, and has no data wait."""

    def __init__(self, peak_flops: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.peak, self.clock = peak_flops, clock
        self.started: float | None = None
        self.paused: float | None = None
        self.waited: float | None = None
        self.steps_seen = 0
        self.samples = self.tokens = self.flops = self.steps = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak is None:
            self.peak = peak_flops(pl_module.device, compute_dtype(trainer))
        self.started, self.steps_seen = None, trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        work: BatchWork = pl_module.batch_work(batch)  # type: ignore[operator]
        self.samples, self.tokens, self.flops = (
            self.samples + work.samples,
            self.tokens + work.tokens,
            self.flops + work.flops,
        )
        if trainer.global_step == self.steps_seen:  # accumulating gradients: no optimizer step yet
            return
        self.steps += trainer.global_step - self.steps_seen
        self.steps_seen = trainer.global_step
        if self.started is None:  # the first step is warm-up: start the clock at its end
            self.started, self.waited = self.read_clock(pl_module), data_waited(trainer)
            self.samples = self.tokens = self.flops = self.steps = 0
        elif trainer.global_step % trainer.log_every_n_steps == 0:  # type: ignore[attr-defined]
            self.log_interval(trainer, pl_module)

    def log_interval(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now = self.read_clock(pl_module)
        seconds = now - self.started  # type: ignore[operator]
        ranks = data_parallel_size(trainer)
        metrics = {
            "perf/tokens_per_s": self.tokens * ranks / seconds,
            "perf/samples_per_s": self.samples * ranks / seconds,
            "perf/step_time": seconds / self.steps,
        }
        metrics["perf/tokens_per_s_per_device"] = metrics["perf/tokens_per_s"] / trainer.world_size
        metrics["perf/samples_per_s_per_device"] = metrics["perf/samples_per_s"] / trainer.world_size
        waited = data_waited(trainer)
        if waited is not None and self.waited is not None:
            metrics["perf/data_wait"] = min(1.0, (waited - self.waited) / seconds)
        if self.peak:
            metrics["perf/mfu"] = self.flops * ranks / seconds / (self.peak * trainer.world_size)
        metrics |= memory_metrics(pl_module.device)
        # Logged only where Lightning writes: a value logged at another step would stand in its later rows too.
        tokens_per_s = metrics.pop("perf/tokens_per_s")
        pl_module.log_dict(metrics)
        pl_module.log("perf/tokens_per_s", tokens_per_s, prog_bar=True)
        self.started, self.waited = now, waited
        self.samples, self.tokens, self.flops, self.steps = 0, 0, 0, 0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Inside fit, not `trainer.training`: Lightning switches the stage to validating before this hook.
        if trainer.state.fn == TrainerFn.FITTING and self.started is not None:
            self.paused = self.read_clock(pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.paused is not None and self.started is not None:
            self.started += self.read_clock(pl_module) - self.paused
            self.paused = None

    def read_clock(self, pl_module: LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # queued kernels belong to the interval just ended
        return self.clock()
