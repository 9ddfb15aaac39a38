"""The Hydra callback that writes a multirun's report after each of its jobs (configs/hydra/sweep_report/).
Hydra makes it for every run, multirun or not: it loads the report (and the plots) only in a multirun."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from pretraining.launch import is_rank_zero_process

log = logging.getLogger(__name__)


class WriteSweepReport(Callback):
    """After each job of a multirun, write the sweep's report again (`pretraining.extras.sweeps.report`). A
    failure to write it is logged: the sweep's remaining jobs go on."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not is_rank_zero_process():
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            from pretraining.extras.sweeps.report import write_report  # a plain run never loads it

            report = write_report(sweep_dir)
        except Exception:  # the report can be written again later; the sweep's remaining jobs cannot
            log.exception("could not write the sweep report; run `make sweep-report SWEEP=%s`", sweep_dir)
        else:
            log.info("sweep report (%s): %s", report.summary(), sweep_dir / "report.md")
