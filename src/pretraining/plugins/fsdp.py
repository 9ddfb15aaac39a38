"""FSDP2 with a sharding policy: mixed precision, activation checkpointing and CPU offload.

`FSDP2Strategy` is Lightning's `ModelParallelStrategy` plus the policy, and checkpoints written whole
or not at all; the objective applies the policy in `configure_model` (`shard`): each of a backbone's
layers (`Backbone.repeated_layers`) becomes one FSDP unit (its parameters all-gathered just before it runs, freed
after), then the rest of the objective another.

    trainer:
      strategy:
        _target_: pretraining.plugins.fsdp.FSDP2Strategy
        mixed_precision: bf16          # null | bf16 | fp16
        activation_checkpointing: true
        cpu_offload: false
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torchmetrics import Metric

from pretraining.checkpoint import refusing_code
from pretraining.checkpoint.background import BackgroundWriter, host_copy
from pretraining.errors import ConfigError
from pretraining.files import temporary_path
from pretraining.internals import shard_every_rank
from pretraining.models.backbone import backbones

PARAM_DTYPES: dict[str | None, torch.dtype | None] = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Lightning calls these directly, not through `forward` (and `LinearProbe` calls `features`), so FSDP
# must be told to gather the root's parameters (embeddings, heads, a temperature) around them.
FORWARD_METHODS = ("training_step", "validation_step", "on_validation_epoch_end", "features")


@dataclass(frozen=True)
class ShardingPolicy:
    """How `shard` wraps a model. `mixed_precision`: the dtype of the gathered parameters and of the
    compute (gradients are reduced and the optimizer steps in float32); `activation_checkpointing`:
    recompute each block in backward; `cpu_offload`: keep the sharded parameters, gradients and
    optimizer state in host memory."""

    mixed_precision: str | None = None
    activation_checkpointing: bool = False
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.mixed_precision not in PARAM_DTYPES:
            raise ConfigError(
                f"trainer.strategy.mixed_precision={self.mixed_precision!r} must be null, 'bf16' or 'fp16'"
            )

    @property
    def param_dtype(self) -> torch.dtype | None:
        return PARAM_DTYPES[self.mixed_precision]

    def fsdp_options(self) -> dict[str, Any]:
        reduce_dtype = torch.float32 if self.param_dtype is not None else None
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        return {
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce_dtype),
            "offload_policy": offload,
        }


def shard(module: nn.Module, mesh: DeviceMesh, policy: ShardingPolicy) -> None:
    """Apply FSDP2 to `module` in place: each layer of its backbones one unit (checkpointed if the policy
    says so), then the rest as the root unit, whose parameters are gathered around Lightning's step methods
    too."""
    found = backbones(module)
    if not found:
        raise ConfigError(
            f"FSDP shards a backbone's layers: {type(module).__name__} has no pretraining.models.backbone.Backbone; "
            "give it one (model.backbone) or train with trainer=gpu/ddp_cpu"
        )
    options = policy.fsdp_options()
    for backbone in found:
        backbone.checkpoint_activations = policy.activation_checkpointing
        for layer in backbone.repeated_layers():
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(module, name)


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` (its arguments pass through) with the sharding policy the objective
    applies in `configure_model`. `data_parallel_size="auto"` with a given `tensor_parallel_size`
    means every other rank: world size / tensor_parallel_size (Lightning's "auto" is the number of
    nodes). Keep `trainer.precision=32-true` with `mixed_precision`: the policy already computes in
    low precision over float32 master weights; `bf16-mixed` would add autocast on top, `bf16-true`
    would make the master weights themselves bfloat16."""

    def __init__(
        self,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.policy = ShardingPolicy(mixed_precision, activation_checkpointing, cpu_offload)
        self.sharded_saves = save_distributed_checkpoint
        self.checkpoint_group: dist.ProcessGroup | None = None  # background sharded saves' own collectives

    def setup_environment(self) -> None:
        if self.policy.mixed_precision is not None and self.precision_plugin.precision != "32-true":
            raise ConfigError(
                f"trainer.strategy.mixed_precision={self.policy.mixed_precision} casts already; "
                f"trainer.precision={self.precision_plugin.precision} would cast again: set trainer.precision=32-true"
            )
        shard_every_rank(self)
        super().setup_environment()
        if self.sharded_saves:  # made now, so that a gloo that cannot connect stops the run before any work
            self.checkpoint_group = dist.new_group(backend="gloo")

    def teardown(self) -> None:
        if self.checkpoint_group is not None:
            dist.destroy_process_group(self.checkpoint_group)
            self.checkpoint_group = None
        super().teardown()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's save, whole or not at all: a full checkpoint (gathered on rank zero) through the
        checkpoint writer (`AtomicCheckpointIO`), as every other strategy saves; a sharded one as a directory
        of every rank's shards, published by rank zero with its sidecar (`pretraining.checkpoint.sharded`).
        `storage_options` may be a `BackgroundWriter`: the checkpoint is then written while training goes on."""
        path = Path(self.broadcast(str(filepath)))
        if not self.sharded_saves:  # ModelParallelStrategy's own save would refuse storage_options
            return super(ModelParallelStrategy, self).save_checkpoint(checkpoint, path, storage_options)
        # Here, not at the top: a run that saves no shards never loads DCP's writers and readers.
        from pretraining.checkpoint.sharded import save_sharded, save_sharded_async

        temporary = Path(self.broadcast(str(temporary_path(path))))  # rank zero's name, on every rank
        optimizers = enumerate(checkpoint.pop("optimizer_states", []))
        shards = {"state_dict": checkpoint.pop("state_dict")} | {f"optimizer_{i}": state for i, state in optimizers}
        meta = checkpoint if self.is_global_zero else None  # all but the shards, written by rank zero
        if not isinstance(storage_options, BackgroundWriter):
            return save_sharded(shards, meta, temporary, path)
        assert self.checkpoint_group is not None
        finish = save_sharded_async(shards, host_copy(meta), temporary, path, self.checkpoint_group)
        storage_options.submit(path, finish)
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's loader, except that nothing in a checkpoint can run code: a file loads weights-only
        and a sharded directory through `load_sharded_into`."""
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_dir():
            with refusing_code(path):
                return super().load_checkpoint(path, weights_only=True)
        from pretraining.checkpoint.sharded import load_sharded_into  # as in save_checkpoint

        assert self.model is not None and self.lightning_module is not None
        return load_sharded_into(self.model, self.optimizers, path, self.lightning_module.strict_loading)

    def model_to_device(self) -> None:
        if not self.policy.cpu_offload:
            return super().model_to_device()
        # The offload policy keeps the sharded parameters on the host; buffers and metric states move.
        assert self.model is not None
        for module in self.model.modules():
            if isinstance(module, Metric):
                module.to(self.root_device)  # its states are no buffers
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(self.root_device))
        return None
