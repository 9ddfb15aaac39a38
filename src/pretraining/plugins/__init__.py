"""Lightning plugins the trainer is built with: the FSDP2 strategy with its sharding policy (`fsdp`), and the
atomic, verified checkpoint writer (`checkpoint_io`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

if TYPE_CHECKING:
    from pretraining.plugins.fsdp import FSDP2Strategy


def fsdp2_strategy(strategy: Strategy) -> FSDP2Strategy | None:
    """`strategy` if it is the template's FSDP2 strategy, else None. `plugins.fsdp` is loaded only for a
    strategy that can be one (a `ModelParallelStrategy`, its base): a run on one device or DDP never loads it."""
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    from pretraining.plugins.fsdp import FSDP2Strategy

    return strategy if isinstance(strategy, FSDP2Strategy) else None
