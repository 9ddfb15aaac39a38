"""Collectives the template needs outside Lightning's strategy API."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather(value: Any) -> list[Any]:
    """`value` from every rank, in rank order (just `[value]` outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
