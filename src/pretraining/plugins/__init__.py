"""Lightning plugins the trainer is built with: the FSDP2 strategy with its sharding policy, and the
atomic, verified checkpoint writer."""

from pretraining.plugins.checkpoint_io import AtomicCheckpointIO
from pretraining.plugins.fsdp import FSDP2Strategy, ShardingPolicy, shard

__all__ = ["AtomicCheckpointIO", "FSDP2Strategy", "ShardingPolicy", "shard"]
