"""A report of a whole sweep, from what each job left in its directory: its `status.json`
(`pretraining.job_status`), its metrics and its checkpoints. A Hydra callback (`callback.WriteSweepReport`)
writes it again after each job of a multirun; a failed job does not stop the sweep: Hydra runs the remaining
jobs, then exits with the first error.

`pretrain-sweep-report <sweep dir>` (`make sweep-report SWEEP=...`) writes the report on demand, for
a sweep that is finished, still going or was interrupted:

- `report.md` (also printed) and `report.csv`: one row per job with the overrides in which the jobs
  differ, the peak LRs it ran at (AdamW's `lr` and, under Muon, `muon_lr`, each times `lr_scale`: a sweep of
  one key shows what it moved), status, the optimised metric, the step of the newest checkpoint, median
  tokens/s and every final `val/` and `probe/` metric, best first (by the sweeper's `direction`, else lowest first);
- `plots/overlay.png`: the learning curves of every job that logged metrics, on shared panels.
"""

from __future__ import annotations

import csv
import io
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretraining.checkpoint import saved_checkpoints
from pretraining.errors import MissingExtraError
from pretraining.extras.plots.run_logs import METRICS_FILE, PlotError, Series, natural_key, read_metrics, read_overrides
from pretraining.files import write_atomically
from pretraining.job_status import current_status

try:  # the overlay plot needs matplotlib (the `plots` extra); the report itself does not
    from pretraining.extras.plots.plots import plot_overlay
except ModuleNotFoundError as missing:
    if not (missing.name or "").startswith("matplotlib"):
        raise
    NO_PLOTS: MissingExtraError | None = MissingExtraError("the sweep's overlay plot (matplotlib)", "plots")
else:
    NO_PLOTS = None

log = logging.getLogger(__name__)

CONFIG_FILE = Path(".hydra") / "config.yaml"
FINAL_PREFIXES = ("val/", "probe/")  # the metrics a row reports at their last logged value
# The peak LRs a row reports, by the model.optimizer key that sets each (times lr_scale, where the optimizer has it).
RATES = {"lr": "peak lr", "muon_lr": "peak muon_lr"}


class SweepError(ValueError):
    """A directory that is not a sweep; the message says what to pass instead."""


@dataclass
class Job:
    """One job of a sweep, as its directory tells it."""

    directory: Path
    overrides: dict[str, str]  # key -> value of each command-line override (`~key` -> "")
    status: str
    error: str
    metric: str
    rates: dict[str, float]  # column (RATES) -> the job's peak LR
    value: float | None
    step: int | None  # of the newest checkpoint
    tokens_per_s: float | None
    final: dict[str, float]  # the last value of each val/ and probe/ metric


def read_job(job_dir: Path) -> Job:
    status = current_status(job_dir)
    config = OmegaConf.load(job_dir / CONFIG_FILE)
    metric = str(OmegaConf.select(config, "optimized_metric") or "")
    metrics = logged_metrics(job_dir)
    final = {name: series.values[-1] for name, series in metrics.items() if name.startswith(FINAL_PREFIXES)}
    throughput = metrics.get("perf/tokens_per_s")
    saved = saved_checkpoints(job_dir / "checkpoints")
    return Job(
        directory=job_dir,
        overrides=dict(map(split_override, read_overrides(job_dir))),
        status=status["status"],
        error=status.get("error", ""),
        metric=metric,
        rates=peak_rates(config),
        value=final.get(metric, status.get("value")),
        step=saved[0][0] if saved else None,
        tokens_per_s=statistics.median(throughput.values) if throughput else None,
        final=final,
    )


def peak_rates(config: DictConfig | ListConfig) -> dict[str, float]:
    """The peak LRs of a job's config (RATES), each times the optimizer's `lr_scale`; a rate whose value is not
    a number here (an interpolation this process cannot resolve) is left out."""
    rates = {}
    for key, column in RATES.items():
        try:
            rate = OmegaConf.select(config, f"model.optimizer.{key}")
            scale = OmegaConf.select(config, "model.optimizer.lr_scale", default=1.0)
            if rate is not None:
                rates[column] = float(rate) * float(scale)
        except (OmegaConfBaseException, TypeError, ValueError):
            continue
    return rates


def logged_metrics(job_dir: Path) -> dict[str, Series]:
    """The job's metrics so far: none before its first logging step."""
    try:
        return read_metrics(job_dir / METRICS_FILE) if (job_dir / METRICS_FILE).is_file() else {}
    except PlotError:  # a header without rows
        return {}


def find_jobs(sweep_dir: Path) -> list[Job]:
    """The jobs under `sweep_dir`: its subdirectories where Hydra recorded a job's overrides."""
    if not sweep_dir.is_dir():
        raise SweepError(f"{sweep_dir} is not a directory: pass a sweep such as logs/train/multiruns/<sweep>")
    jobs = [path.parent.parent for path in sweep_dir.glob(f"*/{CONFIG_FILE}")]
    if not jobs:
        raise SweepError(
            f"no job directories (with {CONFIG_FILE}) in {sweep_dir}: pass a sweep such as "
            f"logs/train/multiruns/<sweep>, the directory a `pretrain -m ...` run printed"
        )
    return [read_job(job) for job in sorted(jobs, key=natural_key)]


def direction(sweep_dir: Path) -> str:
    """The sweeper's direction (`minimize` or `maximize`) from the sweep's `multirun.yaml`; else minimize."""
    path = sweep_dir / "multirun.yaml"
    sweeper = OmegaConf.load(path).hydra.get("sweeper", {}) if path.is_file() else {}
    return str(sweeper.get("direction", "minimize"))


@dataclass
class Report:
    jobs: list[Job]
    direction: str

    def ranked(self) -> list[Job]:
        """Jobs with a value best first, then the others; failed jobs last."""
        sign = -1 if self.direction == "maximize" else 1
        return sorted(
            self.jobs,
            key=lambda job: (job.status == "failed", job.value is None, sign * (job.value or 0.0)),
        )

    def swept(self) -> list[str]:
        """The override keys whose values differ between the jobs (every key of a single job)."""
        keys = list(dict.fromkeys(key for job in self.jobs for key in job.overrides))
        if len(self.jobs) == 1:
            return keys
        return [key for key in keys if len({job.overrides.get(key) for job in self.jobs}) > 1]  # None: not set

    def table(self) -> tuple[list[str], list[list[str]]]:
        swept = self.swept()
        metrics = sorted({name for job in self.jobs for name in job.final} - {job.metric for job in self.jobs})
        optimised = sorted({job.metric for job in self.jobs if job.metric}) or ["value"]
        rates = [column for column in RATES.values() if any(column in job.rates for job in self.jobs)]
        header = ["job", "status", *swept, *rates, *optimised, "step", "tokens/s", *metrics, "error"]
        rows = []
        for job in self.ranked():
            rows.append(
                [
                    job.directory.name,
                    job.status,
                    *(job.overrides.get(key, "") for key in swept),
                    *(number(job.rates.get(column)) for column in rates),
                    *(number(job.value if job.metric == name else None) for name in optimised),
                    "" if job.step is None else str(job.step),
                    number(job.tokens_per_s),
                    *(number(job.final.get(name)) for name in metrics),
                    job.error,
                ]
            )
        return header, rows

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for job in self.jobs:
            counts[job.status] = counts.get(job.status, 0) + 1
        return ", ".join(f"{count} {status}" for status, count in counts.items())


def split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def number(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)]) + "\n"


def write_report(sweep_dir: Path) -> Report:
    """Write `report.md`, `report.csv` and `plots/overlay.png` for the sweep in `sweep_dir`."""
    report = Report(find_jobs(sweep_dir), direction(sweep_dir))
    header, rows = report.table()
    title = f"# Sweep {sweep_dir.name}: {report.summary()}, best first ({report.direction})\n\n"
    write_atomically(sweep_dir / "report.md", (title + markdown(header, rows)).encode())
    table = io.StringIO()
    csv.writer(table).writerows([header, *rows])
    write_atomically(sweep_dir / "report.csv", table.getvalue().encode())
    plotted = [job.directory for job in report.jobs if (job.directory / METRICS_FILE).is_file()]
    if plotted and NO_PLOTS:
        log.warning("no overlay plot: %s", NO_PLOTS)
    elif plotted:
        try:
            plot_overlay(plotted, sweep_dir / "plots" / "overlay.png")
        except PlotError as error:  # jobs that have not logged anything yet
            log.warning("no overlay plot: %s", error)
    return report
