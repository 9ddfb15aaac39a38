"""What the callback asks of a downstream task, and how its examples are shared out over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import torch.distributed as dist

from pretraining.distributed import gather
from pretraining.objectives.base import PretrainingObjective

Item = TypeVar("Item")
SUITE_FILE = "suite.json"  # a suite's index of its tasks (docs/evals.md, "The bundled suite")


class EvalTask(Protocol):
    """One downstream task (or a group of them) that an objective can score."""

    name: str  # its key in the logs: eval/<name>/<metric>

    def check(self, model: PretrainingObjective) -> None:
        """Raise a `ConfigError` naming the file (and line) or key if the task cannot be scored by `model`:
        called at setup, before any training step."""
        ...

    def evaluate(self, model: PretrainingObjective) -> dict[str, float]:
        """The task's metrics (names without the `eval/<name>/` prefix). Called on every rank at once (in eval
        mode, without gradients); every rank returns the same values, whatever the number of ranks."""
        ...


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 outside a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """This rank's batches of `items` (a contiguous share, in order), as many on every rank: under FSDP every
    rank takes part in every forward, so a rank with fewer batches fills the count with batches of the first
    item; `gathered` drops the results of those filler batches."""
    rank, world = rank_and_world()
    per_rank = -(-len(items) // world)
    mine = list(items[rank * per_rank : (rank + 1) * per_rank])
    batches = [mine[start : start + batch_size] for start in range(0, len(mine), batch_size)]
    count = -(-per_rank // batch_size)
    filler = [items[0]] if items else []
    return batches + [filler] * (count - len(batches))


def gathered(results: list[Item], items: int) -> list[Item]:
    """Every rank's `results` (one per item of its share, filler batches' results left out), concatenated in
    rank order: the results of all `items` items, in their order, on every rank."""
    rank, world = rank_and_world()
    per_rank = -(-items // world)
    own = min(per_rank, max(items - rank * per_rank, 0))
    return [result for part in gather(results[:own]) for result in part]
