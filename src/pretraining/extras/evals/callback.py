"""`DownstreamEvals`: the live model's downstream scores at the end of validation, logged beside `val/`.

At setup (every rank, before any step) the callback reads the suite's `suite.json`, builds the tasks the
objective runs unnamed (`SCORED`) or those `tasks` names, and has each `check` the model: a refusal stops the run
there, naming the key. At the end of the validations it is due at (`due`: chosen by the step, so a resumed run
neither repeats nor skips one) every rank runs every task at once, in eval mode without gradients; each task
shares its items over the ranks itself (`pretraining.extras.evals.task.share`). The scores are logged as
`eval/<task>/<metric>` to every logger, in the validation's row; the time each task took is printed, and the
share of the run's wall time spent evaluating is a line of the run's summary (and kept in the checkpoint).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info

from pretraining.data.contract import training_data
from pretraining.data.formats import ExampleFormat
from pretraining.data.pair_format import TokenizedPairs
from pretraining.errors import ConfigError
from pretraining.extras.evals.harness import HarnessTask
from pretraining.extras.evals.masked_tokens import MaskedTokenTask
from pretraining.extras.evals.retrieval import RetrievalTask
from pretraining.extras.evals.task import SUITE_FILE, EvalTask
from pretraining.objectives.base import PretrainingObjective, frozen, uncompiled
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.ranges import Positive, checked_ranges

KEY = "callbacks.evals"
KINDS = ("harness", "retrieval", "masked_tokens")
# Which kinds of task each objective scores, and which of them it runs when `tasks` names none (a subclass, a
# distillation say, scores its parent's). A masked-LM scores a harness task by pseudo-log-likelihood, a forward
# per token of each choice (a few minutes for 500 items of 4 one-line choices on 2 CPU cores): named only.
SCORED: tuple[tuple[type[PretrainingObjective], tuple[str, ...], tuple[str, ...]], ...] = (
    (CausalLM, ("harness",), ("harness",)),
    (MaskedLM, ("harness", "masked_tokens"), ("masked_tokens",)),
    (Contrastive, ("retrieval",), ("retrieval",)),
)
BUILD_HINT = "build the bundled suite with `make evals` (or `pretrain-evals build`)"


class DownstreamEvals(Callback):
    """Score the model on downstream tasks at the end of validation and log `eval/<task>/<metric>` (module doc).

    - `suite`: the suite's directory (`suite.json` and a folder per task, written by `pretrain-evals build`).
    - `tasks`: None, every task of the suite of the kinds the objective runs unnamed (`SCORED`); or the names to
      run, from the suite or (harness tasks) from the lm-evaluation-harness task YAMLs in the `include` folders.
    - `every_n_validations`: evaluate at the validations of the steps `every_n_validations` validation intervals
      apart (step 0 included), at the last step, and at every validation outside training (`pretrain-eval`).
    - `limit`: at most this many items a task (None: all); `batch_size`: items a forward, on each rank.
    - `trust_task_code`: let harness task YAMLs name Python functions (`!function`): they run as code.
    """

    @checked_ranges(KEY)
    def __init__(
        self,
        suite: str,
        tasks: list[str] | None = None,
        include: list[str] | None = None,
        every_n_validations: Positive = 1,
        limit: Positive | None = None,
        batch_size: Positive = 16,
        trust_task_code: bool = False,
    ) -> None:
        self.suite, self.names, self.include = Path(suite), tasks, [Path(folder) for folder in include or ()]
        self.every, self.limit, self.batch_size = every_n_validations, limit, batch_size
        self.trust_task_code = trust_task_code
        self.tasks: list[EvalTask] | None = None
        self.evaluation_seconds = 0.0  # this process's time evaluating (the goodput extra books it apart)
        self.started = time.time()  # about this process's start: the trainer is built first thing
        self.before = {"seconds": 0.0, "wall_seconds": 0.0}  # the run's earlier attempts', as of their last save

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.tasks is not None:  # once, however many validate and fit calls follow
            return
        model = objective(pl_module)
        self.tasks = self.build_tasks(trainer, model)
        for task in self.tasks:
            task.check(model)
        rank_zero_info(f"downstream evals: {', '.join(task.name for task in self.tasks)} ({self.schedule()})")

    def schedule(self) -> str:
        every = "every validation" if self.every == 1 else f"every {self.every} validation intervals"
        return f"{every}, the last step's and pretrain-eval's"

    def build_tasks(self, trainer: Trainer, model: PretrainingObjective) -> list[EvalTask]:
        """The tasks `tasks` names, or every task of the suite of the kinds `model` runs unnamed (`SCORED`)."""
        kinds, default = scored_kinds(model)
        # Tasks named from `include` alone need no suite.
        listed = {} if self.names and self.include and not self.suite.exists() else read_suite(self.suite)
        names = self.names
        if names is None:
            names = [name for name, entry in listed.items() if entry["kind"] in default]
        if not names:
            raise ConfigError(
                f"{KEY}.suite={self.suite} has no task of the kinds a {type(model).__name__} runs unnamed "
                f"({', '.join(default)}): name tasks in {KEY}.tasks, or {BUILD_HINT}"
            )
        return [self.named_task(name, listed, kinds, trainer, model) for name in names]

    def named_task(
        self, name: str, listed: dict[str, dict[str, Any]], kinds: tuple[str, ...], trainer: Trainer, model: Any
    ) -> EvalTask:
        if name not in listed:
            if not self.include:
                known = ", ".join(sorted(listed)) or "none"
                raise ConfigError(
                    f"{KEY}.tasks names {name!r}, which is not in {self.suite / SUITE_FILE} (its tasks: {known}); "
                    f"for a task YAML of your own, add its folder to {KEY}.include"
                )
            return self.make_task(name, "harness", self.include, trainer)
        kind = listed[name]["kind"]
        if kind not in kinds:
            raise ConfigError(
                f"{KEY}.tasks names {name!r}, a {kind} task, which a {type(model).__name__} does not score (it scores "
                f"{', '.join(kinds)}): leave it out of {KEY}.tasks"
            )
        return self.make_task(name, kind, [self.suite / name], trainer)

    def make_task(self, name: str, kind: str, folders: list[Path], trainer: Trainer) -> EvalTask:
        data_format = training_data(trainer, KEY).format
        return make_task(name, kind, folders, data_format, self.batch_size, self.limit, self.trust_task_code)

    def due(self, trainer: Trainer, step: int) -> bool:
        """Whether the validation of `step` is evaluated: a function of the step alone (never of a count of this
        process's validations), so a resumed run evaluates the steps a run never stopped would have."""
        interval = validation_steps(trainer)
        if interval is None or 0 < trainer.max_steps <= step:  # outside training (pretrain-eval), or the last step
            return True
        return step % (interval * self.every) == 0

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self.tasks:
            return
        step = objective(pl_module).trained_steps
        if not self.due(trainer, step):
            return
        scores: dict[str, float] = {}
        lines, total = [], 0.0
        for task in self.tasks:
            show_on_bar(trainer, f"Evaluating {task.name}")
            start = time.perf_counter()
            with frozen(pl_module), uncompiled():
                metrics = task.evaluate(objective(pl_module))
            seconds = time.perf_counter() - start
            total += seconds
            scores |= {f"eval/{task.name}/{metric}": float(value) for metric, value in metrics.items()}
            shown = " ".join(f"{metric} {value:.4g}" for metric, value in metrics.items())
            lines.append(f"{task.name} {shown} ({seconds:.1f} s)")
        show_on_bar(trainer, "Validation")
        self.evaluation_seconds += total
        # The same values on every rank (each task gathers its items): their max, so Lightning does not warn.
        pl_module.log_dict(scores, sync_dist=True, reduce_fx="max")
        rank_zero_info(f"downstream eval at step {step}: {'; '.join(lines)}; {total:.1f} s")

    def totals(self) -> tuple[float, float]:
        """Seconds spent evaluating and wall seconds, over the run's attempts (the earlier ones to their last save)."""
        wall = self.before["wall_seconds"] + time.time() - self.started
        return self.before["seconds"] + self.evaluation_seconds, wall

    def state_dict(self) -> dict[str, float]:
        seconds, wall = self.totals()
        return {"seconds": seconds, "wall_seconds": wall}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = {key: float(state_dict.get(key, 0.0)) for key in self.before}

    def on_run_end(self, trainer: Trainer, stopped_by: str | None) -> list[str]:
        """The run summary's line (`pretraining.report.HearsTheRunEnd`): the evaluation's share of the wall time."""
        seconds, wall = self.totals()
        return [f"downstream evaluation: {seconds:.1f} s, {seconds / max(wall, 1e-9):.1%} of the run's wall time"]


def make_task(
    name: str,
    kind: str,
    folders: list[Path],
    data_format: ExampleFormat[Any],
    batch_size: int = 16,
    limit: int | None = None,
    trust_task_code: bool = False,
) -> EvalTask:
    """Task `name` of `kind` from its `folders` (a harness task's YAML folders; the others' one folder), for a
    model trained on `data_format`'s examples."""
    if kind == "harness":
        return HarnessTask(name, folders, data_format.tokenizer, batch_size, limit, trust_task_code)
    if kind == "retrieval":
        pairs = cast(TokenizedPairs, data_format)  # a Contrastive model trains on pairs (`build_objective`)
        return RetrievalTask(name, folders[0], pairs, batch_size, limit)
    return MaskedTokenTask(name, folders[0] / f"{name}.jsonl", data_format, batch_size, limit)


def objective(pl_module: LightningModule) -> PretrainingObjective:
    if not isinstance(pl_module, PretrainingObjective):
        raise ConfigError(f"{KEY} scores a pretraining objective, not a {type(pl_module).__name__}: remove ~{KEY}")
    return pl_module


def scored_kinds(model: PretrainingObjective) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kinds of task `model`'s objective scores, and those it runs when no task is named (`SCORED`)."""
    found = next(((kinds, default) for cls, kinds, default in SCORED if isinstance(model, cls)), None)
    if found is None:
        raise ConfigError(f"{KEY}: a {type(model).__name__} scores no downstream task: remove ~{KEY}")
    return found


def read_suite(directory: Path) -> dict[str, dict[str, Any]]:
    """The tasks listed in `directory`'s suite.json (name: entry with its `kind`), refused in one line if unreadable."""
    path = directory / SUITE_FILE
    if not path.is_file():
        raise ConfigError(f"{KEY}.suite={directory}: no {SUITE_FILE} there: {BUILD_HINT}, or point {KEY}.suite at one")
    try:
        suite = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}, line {error.lineno}: not JSON ({error.msg}): {BUILD_HINT} again") from error
    tasks = suite.get("tasks") if isinstance(suite, dict) else None
    if not isinstance(tasks, dict) or not all(
        isinstance(entry, dict) and entry.get("kind") in KINDS for entry in tasks.values()
    ):
        raise ConfigError(f"{path}: no 'tasks' mapping of names to entries with a kind in {KINDS}: {BUILD_HINT} again")
    return tasks


def validation_steps(trainer: Trainer) -> int | None:
    """The optimizer steps between validations in training (`trainer.val_check_interval` in micro-batches, as
    `pretraining.run.build_trainer` sets it); None for a trainer that validates by no step interval."""
    every = trainer.val_check_interval
    if not isinstance(every, int) or isinstance(every, bool) or trainer.max_steps <= 0:
        return None
    return max(every // trainer.accumulate_grad_batches, 1)


def show_on_bar(trainer: Trainer, description: str) -> None:
    """Say on the validation progress bar what runs now, if it is Lightning's (tqdm) bar and shown."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled and trainer.is_global_zero:
        bar.val_progress_bar.set_description(description)
