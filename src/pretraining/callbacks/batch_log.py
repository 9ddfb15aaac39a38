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
