"""An audit log of what every step trained on, to check that a resumed run repeats the original."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class BatchLog(Callback):
    """Append one JSON line per training batch to `<dir>/rank<N>.jsonl`: the step, the batch's
    sample ids and its loss as an exact float (`float.hex`).

    A restarted run appends the batches it replays again; the later line wins.
    Off by default (it syncs with the device every step): add it with
    `+callbacks.batch_log._target_=pretraining.callbacks.BatchLog +callbacks.batch_log.dir=...`.
    """

    def __init__(self, dir: str) -> None:
        self.dir = Path(dir)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        record = {
            "batch": trainer.datamodule.batches_consumed,  # type: ignore[attr-defined]
            "step": trainer.global_step,
            "samples": batch["sample_id"].tolist(),
            "loss": float(loss).hex(),
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / f"rank{trainer.global_rank}.jsonl").open("a") as file:
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
