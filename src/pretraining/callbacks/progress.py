"""The training progress bar, counting toward `max_steps`: an infinite stream has no epoch end to count to."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Lightning's bar with `max_steps` (in micro-batches) as its total, from where a resumed run starts, so
    its time left is the run's and its rate this process's; it shows `Throughput`'s tokens/s as `tok/s`."""

    def on_train_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.count_to_max_steps(trainer)  # a run resumed inside its epoch starts none (no epoch-start hook)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)  # which counts to the epoch's end (unknown: no total)
        self.count_to_max_steps(trainer)

    def count_to_max_steps(self, trainer: Trainer) -> None:
        """Count from the micro-batches done before this process to `max_steps`' (none: Lightning's count)."""
        if trainer.max_steps > 0:
            bar = self.train_progress_bar
            done = trainer.global_step * trainer.accumulate_grad_batches
            bar.total = trainer.max_steps * trainer.accumulate_grad_batches
            bar.initial = bar.n = bar.last_print_n = done  # tqdm's rate counts from `initial`: this process's
            bar.set_description("Training")

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: the run directory already says which run this is
        tokens_per_s = metrics.pop("perf/tokens_per_s", None)
        if isinstance(tokens_per_s, float):
            metrics["tok/s"] = f"{tokens_per_s:,.0f}"
        return metrics
