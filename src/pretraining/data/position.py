"""The training data position of one rank, saved in every checkpoint and restored on resume.

The DataModule advances it with each batch the loop consumes (`on_before_batch_transfer` sees consumed
batches, not prefetched ones). `state_dict()` gathers every rank's cursors into rank zero's checkpoint, and
the training loader always starts from them: a stream skips its finished shards by arithmetic and re-reads
only its current one, whatever the number of devices now.

The randomness of training is keyed on the same position: before each micro-batch every generator is seeded
from (seed, step, slot) (`seed_step`), so a resumed run, or one process accumulating gradients, draws exactly
what the uninterrupted run on any number of devices draws. (MLM masks are keyed on sample ids.)
"""

from __future__ import annotations

import hashlib
import json
import random
import warnings
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from pretraining.data.batches import BatchPlan
from pretraining.data.formats import Tensors
from pretraining.data.mixture import Source
from pretraining.data.stream import Cursor
from pretraining.distributed import gather
from pretraining.errors import CheckpointError, ShardError


class DataPosition:
    """Where one rank's training data continues, and what its consumed batches drew, over `sources` read in
    `sub_streams` sub-streams each (`data.streams` x workers)."""

    FORMAT = 3  # 2: one source, cursors [sub, shard, block] (read as a mixture of one: `pretraining.compat`)

    def __init__(self, sources: list[Source], sub_streams: int) -> None:
        self.sources, self.sub_streams = sources, sub_streams
        self.batches_consumed = 0  # training micro-batches this rank has consumed
        self.cursors: dict[tuple[int, int], Cursor] = {}  # by (source, sub-stream) this rank reads
        self.samples_read = self.samples_skipped = 0
        self.drawn = [0] * len(self.sources)  # examples each source gave
        self.ran_out: set[int] = set()  # sources run out (max_epochs) in a sub-stream this rank reads
        self.stopped_by: dict[str, int | None] = {}  # sources whose running out stopped the run, with their caps
        self.phases = [{"step": 0, "weights": self.weights}]  # the mixture's weights, from the step each took effect

    @property
    def weights(self) -> dict[str, float]:
        return {source.name: source.weight for source in self.sources}

    @property
    def data_version(self) -> str:
        """The manifest's version for one source; for a mixture, a hash of its sources' names and versions
        (weights are compared apart on resume: `mixture_settings`)."""
        if len(self.sources) == 1:
            return self.sources[0].manifest.version
        versions = {source.name: source.manifest.version for source in self.sources}
        return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:16]

    def advance(self, batch: Tensors) -> None:
        """Take the position a consumed training batch carries off it (the model never sees it)."""
        for source, sub, shard, block in batch.pop("positions").tolist():
            self.cursors[source, sub] = Cursor(shard, block)
        for source, drawn in enumerate(batch.pop("drawn").tolist()):
            self.drawn[source] += drawn
        self.ran_out |= {source for source, out in enumerate(batch.pop("ran_out").tolist()) if out}
        self.batches_consumed += 1
        self.samples_read += int(batch.pop("read"))
        self.samples_skipped += int(batch.pop("skipped"))

    def state_dict(self, topology: dict[str, Any], accumulation: int) -> dict[str, Any]:
        """The data position of every rank (a collective under DDP/FSDP: every rank calls it on save)."""
        ranks = gather((self.cursors, self.samples_read, self.samples_skipped, self.drawn, self.ran_out))
        cursors = {key: cursor for rank_cursors, *_ in ranks for key, cursor in rank_cursors.items()}
        names = [source.name for source in self.sources]
        return {
            "format": self.FORMAT,
            "data_version": self.data_version,
            "versions": {source.name: source.manifest.version for source in self.sources},
            "topology": topology,
            "steps": self.batches_consumed // accumulation,
            "cursors": [[names[source], sub, c.shard, c.block] for (source, sub), c in sorted(cursors.items())],
            "samples_read": sum(read for _, read, *_ in ranks),
            "samples_skipped": sum(skipped for _, _, skipped, *_ in ranks),
            "drawn": {name: sum(rank[3][index] for rank in ranks) for index, name in enumerate(names)},
            "ran_out": {names[index]: self.sources[index].settings.max_epochs for *_, out in ranks for index in out},
            "stopped_by": self.stopped_by,
            "phases": self.phases,
        }

    def load_state_dict(self, state: dict[str, Any], topology: dict[str, Any], plan: BatchPlan, rank: int) -> None:
        """Continue from a saved position: each unchanged source from its cursors (exactly if the topology is
        unchanged, else approximately), a changed or new one from its start (`pretraining.resume` decides what
        may change). New mixture weights start a phase at the saved step."""
        state = self.in_current_format(state, plan.global_batch)
        steps = state["steps"]
        self.batches_consumed = steps * plan.accumulation
        # The totals go to rank zero only: summed over ranks, they stay the totals.
        first = rank == 0
        self.samples_read = state["samples_read"] if first else 0
        self.samples_skipped = state["samples_skipped"] if first else 0
        self.drawn = [state["drawn"].get(source.name, 0) if first else 0 for source in self.sources]
        self.phases = list(state["phases"])
        self.ran_out = self.still_run_out(state.get("ran_out", {}), state.get("stopped_by", {}))
        if self.phases[-1]["weights"] != self.weights:
            self.phases.append({"step": steps, "weights": self.weights})
            rank_zero_info(f"data.sources: the weights {self.weights} take effect at step {steps}")
        index = {source.name: number for number, source in enumerate(self.sources)}
        unchanged = {
            name
            for name, version in state["versions"].items()
            if name in index and self.sources[index[name]].manifest.version == version
        }
        for source in self.sources:
            if source.name not in unchanged:
                warnings.warn(
                    f"the shards of {source.settings.key}.dir are not the checkpoint's: they are read from their start",
                    stacklevel=1,
                )
        saved = {
            (index[name], sub): Cursor(shard, block)
            for name, sub, shard, block in state["cursors"]
            if name in unchanged
        }
        self.cursors = own(saved if state["topology"] == topology else self.moved(saved, state, topology), plan, rank)

    def moved(
        self, saved: dict[tuple[int, int], Cursor], state: dict[str, Any], topology: dict[str, Any]
    ) -> dict[tuple[int, int], Cursor]:
        """The cursors of a position saved under another topology: every sub-stream of a source starts at the
        shards the old run finished of it, shared out among the new ones (rounded up). Approximate: a shard in
        progress may be skipped or read again."""
        starts = {}
        for number in range(len(self.sources)):
            done = sum(cursor.shard for (source, _), cursor in saved.items() if source == number)
            starts[number] = Cursor(-(-done // self.sub_streams))
        by_source = " (by source)" if len(starts) > 1 else ""
        warnings.warn(
            f"data topology changed from {state['topology']} to {topology}: the stream resumes approximately, at "
            f"shard {', '.join(str(start.shard) for start in starts.values())} of every stream{by_source}",
            stacklevel=1,
        )
        return {(number, sub): start for number, start in starts.items() for sub in range(self.sub_streams)}

    def still_run_out(self, ran_out: dict[str, int], stopped_by: dict[str, int]) -> set[int]:
        """The sources that ran out before the checkpoint and still have that cap; one that stopped the run
        there (`stopped_by`) refuses to continue it."""
        still = {
            index
            for index, source in enumerate(self.sources)
            if ran_out.get(source.name, 0) == source.settings.max_epochs
        }
        stopped = [self.sources[index].settings for index in sorted(still) if self.sources[index].name in stopped_by]
        stopped = [source for source in stopped if source.exhausted == "stop"]
        if stopped:
            keys = ", ".join(source.key for source in stopped)
            raise ShardError(
                f"{keys} ran out before this checkpoint (max_epochs) and stopped the run: to continue it, raise "
                f"{stopped[0].key}.max_epochs (or pass ++{stopped[0].key}.exhausted=renormalise to go on without it), "
                f"with resume_allow=[mixture]"
            )
        return still

    def stop_reason(self, ran_out: list[bool]) -> str | None:
        """Why the run stops at this step, if it does: a source with `exhausted: stop` ran out on any rank
        (`ran_out`, over all ranks)."""
        stopped = [source.settings for source, out in zip(self.sources, ran_out, strict=True) if out]
        stopped = [source for source in stopped if source.exhausted == "stop"]
        if not stopped:
            return None
        self.stopped_by = {source.name: source.max_epochs for source in stopped}
        source = stopped[0]
        return (
            f"{source.key} has run out: its shards were read max_epochs={source.max_epochs} times, and its share "
            f"filled by the other sources since (at most trainer.log_every_n_steps steps); saving and stopping "
            f"({source.key}.exhausted=stop). To go on, raise {source.key}.max_epochs, or pass ++{source.key}.exhausted="
            f"renormalise, and continue with resume_allow=[mixture]"
        )

    def in_current_format(self, state: dict[str, Any], global_batch: int) -> dict[str, Any]:
        """A saved position in this code's format, its sources under this run's names (`renamed`)."""
        if state.get("format") == 2:  # one directory's, unnamed: `renamed` gives it this run's name
            from pretraining.compat import position_of_format_2  # only a checkpoint of before 0.9 needs it

            state = position_of_format_2(state, global_batch)
        elif state.get("format") != self.FORMAT:
            raise CheckpointError(
                f"the checkpoint's data position has format {state.get('format')}, this code reads "
                f"{self.FORMAT}: resume it with the code revision that wrote it"
            )
        state = self.renamed(state)
        # A mixture of one draws from it whatever its weight: one phase, this run's, unless the run was a mixture
        # before (its phases are the lineage of those steps, kept).
        if len(self.sources) == 1 and all(len(phase["weights"]) == 1 for phase in state["phases"]):
            state = state | {"phases": [{"step": 0, "weights": self.weights}]}
        return state

    def renamed(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved position under this run's source names: a saved source the run does not name is its one
        source of the same version (a renamed source, a `data.dir` run continued as a mixture), or the run's
        source where both have one."""
        current = {source.name: source.manifest.version for source in self.sources}
        free = {name: version for name, version in current.items() if name not in state["versions"]}
        mapping = {}
        for name, version in state["versions"].items():
            same = [new for new, new_version in free.items() if new_version == version]
            if name not in current and len(same) == 1:
                mapping[name] = same[0]
                del free[same[0]]
        if len(state["versions"]) == len(self.sources) == 1 and not mapping and not state["versions"].keys() & current:
            mapping = {next(iter(state["versions"])): self.sources[0].name}
        if not mapping:
            return state

        def by_new_name(entries: dict[str, Any]) -> dict[str, Any]:
            return {mapping.get(name, name): value for name, value in entries.items()}

        return state | {
            "versions": by_new_name(state["versions"]),
            "cursors": [[mapping.get(name, name), *rest] for name, *rest in state["cursors"]],
            "drawn": by_new_name(state["drawn"]),
            "ran_out": by_new_name(state.get("ran_out", {})),
            "stopped_by": by_new_name(state.get("stopped_by", {})),
            "phases": [phase | {"weights": by_new_name(phase["weights"])} for phase in state["phases"]],
        }


def own(cursors: dict[tuple[int, int], Cursor], plan: BatchPlan, rank: int) -> dict[tuple[int, int], Cursor]:
    """The cursors of the sub-streams `rank` reads: the gathered position then holds each from the rank that
    moves it."""
    mine = plan.streams_of_rank(rank)
    return {(source, sub): cursor for (source, sub), cursor in cursors.items() if sub % plan.streams in mine}


def seed_step(seed: int) -> None:
    """Seed Python's `random`, NumPy and torch (CPU, CUDA, MPS): `torch.manual_seed` without its look for
    every other backend, which costs a small model's step more than the rest of the seeding."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # a run on the GPU has started CUDA before its first batch
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)
