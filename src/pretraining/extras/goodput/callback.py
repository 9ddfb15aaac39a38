"""`Goodput`: the callback that keeps a run's goodput record, holds it to a budget and raises alerts."""

from __future__ import annotations

import math
import os
import socket
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Any, Protocol, cast, get_args, runtime_checkable

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.callbacks.lineage import trainer_lineage
from pretraining.callbacks.preemption import Preempted
from pretraining.checkpoint.sidecar import read_sidecar
from pretraining.data.loader import WaitTimedLoader
from pretraining.errors import ConfigError, PretrainingError
from pretraining.extras.goodput import alerts
from pretraining.extras.goodput.account import (
    AttemptAccount,
    RunAccount,
    account_attempt,
    account_attempts,
    account_run,
    amount,
)
from pretraining.extras.goodput.alerts import Condition
from pretraining.extras.goodput.record import (
    LATEST_TIME,
    RECORD_FILE,
    SPENT_ON,
    Attempt,
    RecordWriter,
    count_rebuilt_starts_on,
    number,
    read_record,
)
from pretraining.files import appendable_file
from pretraining.job_status import read_status
from pretraining.objectives.step_values import logs_written_at
from pretraining.ranges import Positive, Range, checked_ranges

NonNegative = Annotated[float, Range(ge=0)]
Share = Annotated[float, Range(gt=0, lt=1)]
MEDIAN_INTERVALS = 1000  # the slow-step alert's median is over at most this many logging intervals


@runtime_checkable
class SpendsEvaluation(Protocol):
    """A callback that runs downstream evaluations (the evals extra's `DownstreamEvals`): its seconds so far in this
    process, booked to `evaluation` rather than to the validation they run in."""

    evaluation_seconds: float


class Goodput(Callback):
    """Account for the run's time across restarts in `<dir>/goodput.jsonl` (`pretraining.extras.goodput.record`;
    rank zero writes it), log `goodput/goodput` (and `goodput/device_hours`, `goodput/cost`, `goodput/restarts`)
    at every validation, add the goodput and cost line to the run's summary, stop at a budget and warn once a
    run about each alert condition (`pretraining.extras.goodput.alerts`).

    The clock is read at the trainer's hooks, at logging steps and after saves, never inside a step. The
    budget and the alerts are rank zero's (its clock, its loader): the other ranks follow its stop.

    - `device_hour`: the price of one device for an hour (any currency), for the cost figures.
    - `max_device_hours`, `max_cost` (needs `device_hour`): the budget over every attempt of the run. Reached,
      the run stops at the next logging step, saving it; a restart with the budget spent is refused.
    - Alerts (null turns one off): `flat_validations` validations in which `monitor` (lower is better) did
      not improve by more than `min_improvement`; steps slower than the process's median by `slow_share`
      over `slow_steps` steps; a data wait over `data_wait_share` of those steps; more than
      `restarts_per_hour` restarts in an hour; a restore over `restore_seconds`. `stop_on` names the ones that
      also stop the run (with a checkpoint).
    """

    @checked_ranges("callbacks.goodput")
    def __init__(
        self,
        dir: str,
        heartbeat_seconds: NonNegative = 10.0,
        device_hour: NonNegative | None = None,
        max_device_hours: Annotated[float, Range(gt=0)] | None = None,
        max_cost: Annotated[float, Range(gt=0)] | None = None,
        monitor: str = "val/loss",
        flat_validations: Positive | None = 5,
        min_improvement: NonNegative = 0.0,
        slow_share: Share | None = 0.5,
        slow_steps: Positive = 100,
        data_wait_share: Share | None = 0.2,
        restarts_per_hour: Positive | None = 3,
        restore_seconds: NonNegative | None = 600.0,
        stop_on: list[Condition] | None = None,
    ) -> None:
        if max_cost is not None and device_hour is None:
            raise ConfigError(
                f"callbacks.goodput.max_cost={max_cost} needs a price: set callbacks.goodput.device_hour (the cost of "
                "one device for an hour), or budget in callbacks.goodput.max_device_hours"
            )
        unknown = sorted(set(stop_on or ()) - set(get_args(Condition)))
        if unknown:
            raise ConfigError(f"callbacks.goodput.stop_on names no alert: {unknown}; the alerts: {get_args(Condition)}")
        self.path = Path(dir) / RECORD_FILE
        self.heartbeat, self.device_hour = heartbeat_seconds, device_hour
        # The budget in device-hours: the tighter of the limits given (a cost at the price), and the key that set it.
        limits: dict[str, tuple[float, float]] = {}  # key: (its value, in device-hours)
        if max_device_hours is not None:
            limits["max_device_hours"] = (max_device_hours, max_device_hours)
        if max_cost is not None and device_hour:
            limits["max_cost"] = (max_cost, max_cost / device_hour)
        self.budget_key, (self.budget_given, self.budget) = min(
            limits.items(), key=lambda item: item[1][1], default=("", (0.0, math.inf))
        )
        self.monitor, self.flat_validations, self.min_improvement = monitor, flat_validations, min_improvement
        self.slow_share, self.slow_steps, self.data_wait_share = slow_share, slow_steps, data_wait_share
        self.restarts_per_hour, self.restore_seconds = restarts_per_hour, restore_seconds
        self.stop_on = set(stop_on or ())
        self.may_stop = self.budget < math.inf or bool(self.stop_on)  # else no rank asks the others
        self.earlier = self.read_earlier_attempts()
        self.started = attempt_start_time(Path(dir))
        self.spent_before = account_run(self.earlier).device_hours
        # Refused here, before the loggers start; but a finished run run again only reports its metrics
        # (`pretraining.run.finished`, before any set-up), and one extended later is refused at its set-up.
        if not self.earlier or self.earlier[-1].cause != "completed":
            self.refuse_a_spent_budget()
        self.deadline = math.inf  # when the budget is spent, once the devices are known
        self.activity, self.since = "startup", self.started
        self.spent = dict.fromkeys(SPENT_ON, 0.0)
        self.saving_seen = self.waited_seen = self.evaluating_seen = 0.0
        self.loader: WaitTimedLoader | None = None
        self.writer: RecordWriter | None = None
        self.attempt = 0
        self.start: dict[str, Any] | None = None  # this attempt's first line, once written
        self.earlier_accounts: list[AttemptAccount] = []
        self.alerted = {line["condition"] for line in lines_of(self.earlier, "alert")}
        # The monitored metric at each validated step, over the attempts.
        self.validated = {
            line["step"]: line["value"] for line in lines_of(self.earlier, "validation") if "value" in line
        }
        self.step_times: deque[float] = deque(maxlen=MEDIAN_INTERVALS)  # seconds a step, each logging interval
        self.interval_marks: list[tuple[float, float, int]] = []  # (training, data wait, step) at logging steps
        self.step_seen, self.in_fit, self.worked, self.line_due = -1, False, False, False
        self.last_line = 0.0
        self.asking: str | None = None  # why rank zero asks the ranks to stop, until they do
        self.stop_reason: str | None = None  # pretraining.report.StopsTraining

    def read_earlier_attempts(self) -> list[Attempt]:
        """The run's attempts before this one, read on every rank before any rank's set-up (rank zero then adds to
        the record); damaged lines are left out, with a warning: a damaged record never stops training. The budget
        counts the readable attempts' time, never less: no line is read as a NaN, negative or huge time."""
        appendable_file(self.path, "the goodput record", "move it aside: the run starts a new record")
        if not self.path.exists():
            return []
        record = read_record(self.path)
        damage = record.damage()
        if damage:
            rank_zero_warn(damage)
        return record.attempts

    # Where the time goes: at each hook that begins another activity, the time since the last one is booked
    # to it, less the saves', evaluations' and data waits' shares (their counters are read then).
    def book(self, trainer: Trainer, activity: str) -> None:
        now = time.time()
        saving = sum(c.saving_seconds for c in trainer.checkpoint_callbacks if isinstance(c, StepCheckpoint))
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        evaluating = sum(c.evaluation_seconds for c in callbacks if isinstance(c, SpendsEvaluation))
        loader = trainer.train_dataloader if isinstance(trainer.train_dataloader, WaitTimedLoader) else None
        if loader is not self.loader:  # a new fit's loader counts from 0
            self.loader, self.waited_seen = loader, 0.0
        waited = loader.waited if loader is not None else 0.0
        saved, wait, evaluated = saving - self.saving_seen, waited - self.waited_seen, evaluating - self.evaluating_seen
        self.spent[self.activity] += now - self.since - saved - wait - evaluated
        self.spent["saving"] += saved
        self.spent["data_wait"] += wait
        self.spent["evaluation"] += evaluated
        self.activity, self.since, self.saving_seen, self.waited_seen = activity, now, saving, waited
        self.evaluating_seen = evaluating

    def write(self, trainer: Trainer, event: str, **fields: Any) -> dict[str, Any]:
        """Book the time so far; the record's line for now (written by rank zero)."""
        self.book(trainer, self.activity)
        self.line_due, self.last_line = False, self.since
        line = {"attempt": self.attempt, "event": event, "t": self.since, "step": self.step(trainer)}
        line |= {"spent": dict(self.spent)} | fields
        if self.writer is not None:
            self.writer.write(line)
        return line

    def step(self, trainer: Trainer) -> int:
        """The optimizer steps done: Lightning counts those of a resumed run only once the fit has restored them."""
        resumed = self.start["resumed_from"] if self.start else None
        return max(trainer.global_step, resumed or 0)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.start is None:
            self.begin(trainer, pl_module)
        self.book(trainer, "other" if self.worked else "setup")  # a later stage's set-up is no restore

    def begin(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The first set-up of this process: this attempt's start in the record."""
        # An attempt whose start is damaged counts at least this run's devices, known only now.
        count_rebuilt_starts_on(self.earlier, trainer.world_size)
        self.spent_before = account_run(self.earlier).device_hours
        self.refuse_a_spent_budget()
        # Every rank's account starts at rank zero's clock (the goodput logged is their mean).
        self.started = self.since = trainer.strategy.broadcast(self.started)
        self.attempt = (self.earlier[-1].number if self.earlier else 0) + 1
        self.deadline = self.started + (self.budget - self.spent_before) * 3600 / trainer.world_size
        device = pl_module.device
        fields = {
            "started": self.started,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "devices": trainer.world_size,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "resumed_from": resumed_step(trainer),
            "max_steps": trainer.max_steps,
            "device_hour": self.device_hour,
        }
        self.start = {"resumed_from": fields["resumed_from"]}  # for `step` while the line is made
        if trainer.is_global_zero:
            self.writer = RecordWriter(self.path)
        self.start = self.write(trainer, "start", **fields)
        # The earlier attempts' figures are fixed once this one's resumed step is known: worked out once.
        self.earlier_accounts = account_attempts([*self.earlier, Attempt(self.start, [])])[:-1]
        if self.restarts_per_hour is not None:
            starts = [attempt.start["started"] for attempt in self.earlier] + [self.started]
            crashed = [start for before, start in zip(self.earlier, starts[1:], strict=True) if crashed_out(before)]
            self.alert(trainer, "crash_loop", alerts.crash_loop(crashed, time.time(), self.restarts_per_hour))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.first_work(trainer)
        self.book(trainer, "training")
        self.in_fit = True
        self.interval_marks = [(self.spent["training"], self.spent["data_wait"], trainer.global_step)]
        self.write(trainer, "progress")  # the set-up (the restore) is accounted for, whatever comes next

    def first_work(self, trainer: Trainer) -> None:
        """At the first step or validation: a resumed process's set-up so far is its restore."""
        if self.worked:
            return
        self.worked = True
        if self.restore_seconds is not None and self.start and self.start["resumed_from"] is not None:
            self.book(trainer, self.activity)
            self.alert(trainer, "slow_restore", alerts.slow_restore(self.spent["setup"], self.restore_seconds))

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.line_due:  # a save just ended: the line of its step, for the account of a later restart
            self.write(trainer, "progress")

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.line_due = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self.step_seen or not logs_written_at(trainer, step):
            return  # mid-accumulation, or not a logging step: nothing to do
        self.step_seen = step
        self.book(trainer, "training")
        self.check_steps(trainer)
        if self.since >= self.deadline and trainer.is_global_zero:
            spent = self.spent_before + (self.since - self.started) * trainer.world_size / 3600
            self.asking = (
                self.asking or f"{self.budget_spent(spent)}; this step is saved. To continue, {self.to_continue()}"
            )
        # Every rank at the same steps: all stop at the step rank zero asks to.
        if self.may_stop and trainer.strategy.reduce_boolean_decision(self.asking is not None, all=False):
            trainer.should_stop = True  # StepCheckpoint, after this callback, saves the step
            self.stop_reason = self.asking
        if self.since - self.last_line >= self.heartbeat:
            self.write(trainer, "progress")

    def check_steps(self, trainer: Trainer) -> None:
        """At a logging step: the interval's seconds a step, and (rank zero's) slow-step and data-wait alerts."""
        training, waited, step = self.spent["training"], self.spent["data_wait"], trainer.global_step
        last_training, _, last_step = self.interval_marks[-1]
        if step > last_step:
            self.step_times.append((training - last_training) / (step - last_step))
        if len(self.step_times) == 1:  # the first interval (compilation, workers starting) measures neither alert
            self.interval_marks = []
        self.interval_marks.append((training, waited, step))
        window = math.ceil(self.slow_steps / trainer.log_every_n_steps)  # type: ignore[attr-defined]
        del self.interval_marks[: -window - 1]
        if not trainer.is_global_zero:
            return
        if self.slow_share is not None and "slow_steps" not in self.alerted:
            self.alert(trainer, "slow_steps", alerts.slow_steps(list(self.step_times), window, self.slow_share))
        if self.data_wait_share is not None and len(self.interval_marks) > window:
            old_training, old_waited, _ = self.interval_marks[0]
            busy = training - old_training + waited - old_waited
            self.alert(trainer, "data_wait", alerts.data_wait(waited - old_waited, busy, self.data_wait_share))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.line_due:
            self.write(trainer, "progress")
        self.first_work(trainer)
        self.book(trainer, "validation")

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if time.time() - self.last_line >= self.heartbeat:  # a long validation is accounted for as it goes
            self.write(trainer, "progress")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.start is None:
            return
        self.book(trainer, self.activity)
        account = self.account(trainer)
        logged = {"goodput/goodput": account.goodput, "goodput/device_hours": account.device_hours}
        logged["goodput/restarts"] = float(account.restarts)
        cost = account.cost(account.device_hours)
        if cost is not None:
            logged["goodput/cost"] = cost
        pl_module.log_dict(logged, sync_dist=True)  # each rank's account of the same record: their mean

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.book(trainer, "training" if self.in_fit else "other")
        value = trainer.callback_metrics.get(self.monitor)
        if value is None or not math.isfinite(float(value)):  # NaN improves on nothing, and is no value of the record
            self.write(trainer, "validation")
            return
        self.validated[self.step(trainer)] = float(value)
        self.write(trainer, "validation", value=float(value))
        if self.flat_validations is not None and trainer.is_global_zero:
            values = [self.validated[step] for step in sorted(self.validated)]
            flat = alerts.no_improvement(values, self.monitor, self.flat_validations, self.min_improvement)
            self.alert(trainer, "no_improvement", flat)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.in_fit = False
        self.book(trainer, "other")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # The record stays open: a stop that ends in `report` (a signal in a validation) writes the last line.
        if self.start is None or isinstance(exception, Preempted):
            return
        if isinstance(exception, PretrainingError) and not self.worked:  # a refused start is no attempt
            if self.writer is not None:
                self.writer.withdraw()
            self.writer = self.start = None
            return
        self.write(trainer, "end", cause=f"error: {type(exception).__name__}: {exception}".rstrip(": "))

    def on_run_end(self, trainer: Trainer, stopped_by: str | None) -> list[str]:
        """The run's end (`pretraining.report.HearsTheRunEnd`): the last line of this attempt, and the summary's."""
        if self.start is None:
            return []
        self.book(trainer, "other")
        self.write(trainer, "end", cause=stopped_by or "completed")
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        account = self.account(trainer)
        cost = account.cost(account.device_hours)
        priced = f", cost {amount(cost)}" if cost is not None else " (set callbacks.goodput.device_hour for its cost)"
        return [
            f"goodput {account.goodput:.1%} over {len(account.attempts)} attempt(s), {account.restarts} restart(s); "
            f"{amount(account.device_hours)} device-hours{priced}; the account: pretrain-goodput {self.path.parent}"
        ]

    def account(self, trainer: Trainer) -> RunAccount:
        """The run's account so far: the earlier attempts' and this one's, to the time last booked."""
        assert self.start is not None
        now = {"attempt": self.attempt, "event": "progress", "t": self.since, "step": self.step(trainer)}
        current = account_attempt(Attempt(self.start, [now | {"spent": dict(self.spent)}]), None)
        return RunAccount([*self.earlier_accounts, current], self.start["max_steps"], self.device_hour)

    def refuse_a_spent_budget(self) -> None:
        if self.spent_before >= self.budget:
            spent = self.budget_spent(self.spent_before)
            raise ConfigError(f"{spent}; nothing was started. To continue, {self.to_continue()}")

    def budget_spent(self, device_hours: float) -> str:
        """The budget is spent, in words: how much of which limit."""
        cost = "" if self.device_hour is None else f" (cost {amount(device_hours * self.device_hour)})"
        return (
            f"the run's budget is spent: {amount(device_hours)} device-hours{cost} over all its attempts, of "
            f"callbacks.goodput.{self.budget_key}={self.budget_given:g}"
        )

    def to_continue(self) -> str:
        return (
            f"raise callbacks.goodput.{self.budget_key} and run the command again on this run's directory, "
            f"{self.path.parent} (pass its run_name: a changed override names another run)"
        )

    def alert(self, trainer: Trainer, condition: Condition, message: str | None) -> None:
        """Warn about `condition` (once a run: the record keeps the alerts raised) on the console and the log,
        and in W&B (`alert`); ask to stop the run at the next logging step if `stop_on` names it. Rank zero's."""
        if message is None or condition in self.alerted or not trainer.is_global_zero:
            return
        self.alerted.add(condition)
        rank_zero_warn(f"goodput alert, {condition}: {message}")
        self.write(trainer, "alert", condition=condition, message=message)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.alert(title=f"{condition} ({self.path.parent.name})", text=message)
        if condition in self.stop_on:
            self.asking = self.asking or (
                f"the alert {condition} (callbacks.goodput.stop_on): {message}. This step is saved; run the same "
                "command to continue (each alert is raised once a run)"
            )


def crashed_out(attempt: Attempt) -> bool:
    """Whether an attempt was killed (it wrote no end) or ended by an error."""
    return attempt.cause is None or attempt.cause.startswith("error")


def lines_of(attempts: list[Attempt], event: str) -> list[dict[str, Any]]:
    return [line for attempt in attempts for line in attempt.lines if line["event"] == event]


def resumed_step(trainer: Trainer) -> int | None:
    """The step of the checkpoint the run continues (its sidecar's), None for a fresh start; known at the set-up
    (before Lightning names it) from the run's `Lineage`."""
    lineage = trainer_lineage(trainer)
    if lineage is None or lineage.parent is None:
        return None
    return int(read_sidecar(lineage.parent)["step"])


def attempt_start_time(run_dir: Path) -> float:
    """When this attempt began. For a `pretrain` job (its status record says this process runs it): the process's
    start, or for a multirun's job after the first the job's own (with Hydra's basic launcher the jobs share a
    process); for a run started otherwise (from Python: a notebook, a test), now."""
    status = read_status(run_dir)
    if status.get("status") != "running" or status.get("pid") != os.getpid():
        return time.time()
    hydra = cast(DictConfig, HydraConfig.get()) if HydraConfig.initialized() else None  # a DictConfig at run time
    later_job = hydra is not None and OmegaConf.select(hydra, "job.num", default=0) > 0
    if later_job:
        return status["started"] if number(0, LATEST_TIME)(status.get("started")) else time.time()
    return process_start_time()


def process_start_time() -> float:
    """When this process started (Unix time, to about a second: Linux's /proc); elsewhere, now."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
