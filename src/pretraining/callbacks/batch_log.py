"""An audit log of what every step trained on, to check that a resumed run repeats the original."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from pretraining.data.contract import training_data
from pretraining.files import open_to_append


class BatchLog(Callback):
    """Append one JSON line per training micro-batch to `<dir>/rank<N>.jsonl`: the step, its slot in
    the step's global batch, the number of ranks, the sample ids and the loss as an exact float (`float.hex`; divided by
    the accumulation, as Lightning reports it).

    A restarted run appends the batches it replays again; the later line wins.
    Off by default (it syncs with the device every step): add it with
    `+callbacks.batch_log._target_=pretraining.callbacks.batch_log.BatchLog +callbacks.batch_log.dir=...`.
    """

    def __init__(self, dir: str) -> None:
        self.dir = Path(dir)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        data = training_data(trainer, "callbacks.batch_log")
        step, slot = data.batch_slot
        record = {
            "batch": data.position.batches_consumed,
            "step": step,
            "slot": slot,
            "ranks": trainer.world_size,
            "time": time.time(),
            "samples": batch["sample_id"].tolist(),
            "loss": float(loss).hex(),
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        log = self.dir / f"rank{trainer.global_rank}.jsonl"
        with open_to_append(log, "the batch log", "remove it; the run keeps its own") as file:
            file.write(json.dumps(record) + "\n")


def read_batch_log(path: Path) -> dict[int, dict[str, Any]]:
    """A rank's log by batch number, the last line for a batch winning (a replay after a restart)."""
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {record["batch"]: record for record in records}


def batch_log_differences(reference: Path, resumed: Path) -> list[str]:
    """Where two runs' batch logs (`<run dir>/batches/`) differ: missing ranks or batches, other
    samples, other losses. Empty when the runs trained identically."""
    differences = []
    ranks = sorted({path.name for path in [*reference.glob("rank*.jsonl"), *resumed.glob("rank*.jsonl")]})
    for rank in ranks:
        if not (reference / rank).is_file() or not (resumed / rank).is_file():
            differences.append(f"{rank}: in one run only")
            continue
        expected, actual = read_batch_log(reference / rank), read_batch_log(resumed / rank)
        for batch in sorted(expected.keys() | actual.keys()):
            if batch not in expected or batch not in actual:
                differences.append(f"{rank} batch {batch}: in one run only")
            elif expected[batch]["samples"] != actual[batch]["samples"]:
                differences.append(f"{rank} batch {batch}: other samples")
            elif expected[batch]["loss"] != actual[batch]["loss"]:
                differences.append(f"{rank} batch {batch}: loss {actual[batch]['loss']} != {expected[batch]['loss']}")
    return differences


def global_steps(batches: Path) -> dict[int, tuple[list[int], float]]:
    """Each step of a run's batch logs (`<run dir>/batches/`) seen globally: its samples over all
    ranks in slot order, and its loss (the mean over ranks of each rank's accumulated loss), which
    is what one process would report for the same global batch. A step replayed after a restart on
    another number of ranks counts as the newest layout logged it."""
    records = [record for path in batches.glob("rank*.jsonl") for record in read_batch_log(path).values()]
    newest = {record["step"]: record for record in sorted(records, key=lambda r: r["time"])}
    steps: dict[int, tuple[list[int], float]] = {}
    for record in sorted(records, key=lambda r: (r["step"], r["slot"])):
        if record["ranks"] != newest[record["step"]]["ranks"]:
            continue  # from a layout that was interrupted and replaced
        samples, loss = steps.get(record["step"], ([], 0.0))
        steps[record["step"]] = (samples + record["samples"], loss + float.fromhex(record["loss"]) / record["ranks"])
    return steps
