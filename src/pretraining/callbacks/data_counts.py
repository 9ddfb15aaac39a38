"""What the training data gave, on the logs: samples read and skipped (and their limit), a mixture's shares."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from pretraining.data.contract import training_data
from pretraining.data.sources import check_skips
from pretraining.objectives.step_values import logs_written_at


class DataCounts(Callback):
    """At logging steps, sum over ranks the samples read and skipped and each source's examples; log
    `data/samples_read`, `data/skipped_samples` and a mixture's `data/<source>/tokens` and `/share`; stop on
    too many skips (`pretraining.data.sources.check_skips`) or a source run out (`DataPosition.stop_reason`).
    One small all-reduce at the same steps everywhere, so all ranks stop together. `train.py` adds it to every
    run, as it enforces the data policy; `stop_reason` then says why (`pretraining.report.StopsTraining`)."""

    def __init__(self) -> None:
        self.checked_step = -1
        self.stop_reason: str | None = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self.checked_step or not logs_written_at(trainer, step):
            return  # mid-accumulation, checked already, or not a logging step
        self.checked_step = step
        data = training_data(trainer, "data.bad_data")
        sources, position = len(data.sources), data.position
        ran_out = [source in position.ran_out for source in range(sources)]
        counts = [position.samples_read, position.samples_skipped, *position.drawn, *ran_out]
        summed = trainer.strategy.reduce(torch.tensor(counts, device=pl_module.device), reduce_op="sum")
        read, skipped, *per_source = summed.tolist()
        drawn, ran_out = per_source[:sources], [out > 0 for out in per_source[sources:]]
        logged = {"data/samples_read": read, "data/skipped_samples": skipped}
        if len(drawn) > 1:
            tokens_per_example, total = data.format.example_tokens, max(sum(drawn), 1)
            for source, examples in zip(data.sources, drawn, strict=True):
                logged[f"data/{source.name}/tokens"] = examples * tokens_per_example
                logged[f"data/{source.name}/share"] = examples / total
        pl_module.log_dict(logged)
        check_skips(skipped, read, data.sources, data.max_skip_fraction)
        reason = position.stop_reason(ran_out)
        if reason:  # every rank agrees (the sums are global): the checkpoint callback saves this step
            rank_zero_warn(reason)
            trainer.should_stop, self.stop_reason = True, reason
