"""A Hydra sweeper that runs an Optuna study stored in SQLite in the sweep directory, so that an
interrupted sweep continues where it stopped: `pretrain -m hparams_search=clm` (configs/hydra/sweeper/optuna.yaml,
which names the stub Hydra finds, `hydra_plugins.pretraining_optuna.sweeper`).

Ours rather than the Hydra Optuna plugin, which pins Optuna < 3; this one uses Optuna's ask/tell API.
Search spaces (`hydra.sweeper.params`, or sweep overrides on the command line, which win) use Hydra's
sweep syntax, as that plugin does:

    choice(a, b, c)             one of these values
    range(start, stop, step)    an integer start, start + step, ... below stop
    interval(low, high)         a float in [low, high]; tag(log, interval(...)) samples it on a log
                                scale, tag(int, interval(...)) draws an integer

Other overrides are passed to every trial as they are. Trial N runs in `<sweep dir>/N`. Running the
same command again loads the study: trials an interrupted sweep left running are run again in their
directories (so they continue from their checkpoints), then new trials are asked for until the study
holds `n_trials` finished ones. A failed trial is recorded as failed and the search goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from pretraining.errors import MissingExtraError
from pretraining.internals import failed_job_error

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    """Hydra sweeper: one Optuna trial per job, `n_jobs` jobs launched at a time."""

    def __init__(
        self,
        direction: str,
        n_trials: int,
        n_jobs: int,
        sampler: Any,
        seed: int,
        storage: str | None,
        study_name: str | None,
        params: dict[str, str] | None,
    ) -> None:
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"hydra.sweeper.direction={direction}: use minimize or maximize")
        if n_trials < 1 or n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_trials={n_trials}, n_jobs={n_jobs}: both must be at least 1")
        self.direction, self.n_trials, self.n_jobs = direction, n_trials, n_jobs
        self.sampler, self.seed = sampler, seed
        self.storage, self.study_name, self.params = storage, study_name, dict(params or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        if importlib.util.find_spec("optuna") is None:  # before the sampler (an Optuna class) or any job
            raise MissingExtraError("hparams_search (the Optuna sweeper)", "sweeps")
        if isinstance(self.sampler, DictConfig):  # the config's node (`_recursive_: false`)
            self.sampler = instantiate(self.sampler)
        self.sweep_config = config
        self.job_launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        space, fixed = search_space(self.params, arguments)
        sweep_dir = Path(self.sweep_config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.sweep_config, sweep_dir / "multirun.yaml")
        storage = self.storage or f"sqlite:///{sweep_dir.resolve() / 'optuna.db'}"
        study = optuna.create_study(
            study_name=self.study_name or sweep_dir.name,
            storage=storage,
            direction=cast(Literal["minimize", "maximize"], self.direction),
            load_if_exists=True,
        )
        # Seeded by the trials so far too: a continued study must not draw its first trials' values again.
        study.sampler = self.sampler(seed=self.seed + len(study.trials))
        check_same_study(study, space, self.direction, storage)
        interrupted: list[Any] = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.RUNNING]
        remaining = self.n_trials - sum(trial.state.is_finished() for trial in study.trials)
        log.info(f"study {study.study_name} in {storage}: {len(study.trials)} trials, {max(remaining, 0)} to run")
        while remaining > 0:
            count = min(self.n_jobs, remaining)
            batch = interrupted[:count]
            interrupted = interrupted[count:]
            batch += [study.ask(space) for _ in range(count - len(batch))]
            self.run_trials(study, batch, fixed)
            remaining -= count
        report_best(study, storage)

    def run_trials(self, study: Any, trials: Sequence[Any], fixed: Sequence[str]) -> None:
        """Launch one job per trial (in `<sweep dir>/<trial number>`) and tell the study each outcome."""
        import optuna

        jobs = [
            [*fixed, *(f"{name}={value}" for name, value in trial.params.items()), f"hydra.sweep.subdir={trial.number}"]
            for trial in trials
        ]
        returns = self.job_launcher.launch(jobs, initial_job_idx=trials[0].number)
        for trial, job_return in zip(trials, returns, strict=True):
            value = objective_value(job_return)
            if value is None:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            else:
                study.tell(trial.number, value)


def objective_value(job_return: JobReturn) -> float | None:
    """The value a job returned, or None (logged) if it failed or returned no finite number."""
    if job_return.status != JobStatus.COMPLETED:
        log.warning(f"trial failed: {failed_job_error(job_return)!r}")
        return None
    value = job_return.return_value
    if not isinstance(value, int | float) or not math.isfinite(value):
        log.warning(f"trial returned {value!r}, not a finite number: check `optimized_metric` names a logged metric")
        return None
    return float(value)


def search_space(params: dict[str, str], arguments: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The Optuna distributions of the sweep overrides in `params` and then `arguments` (later ones
    win), and the other overrides as they were written."""
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    lines = [f"{key}={value}" for key, value in params.items()] + list(arguments)
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = str(override.input_line)
    return space, list(fixed.values())


def distribution(override: Override) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    if isinstance(sweep, ChoiceSweep):
        choices = list(override.sweep_iterator())
        if all(choice is None or isinstance(choice, bool | int | float | str) for choice in choices):
            return CategoricalDistribution(cast(list[bool | int | float | str | None], choices))
    if isinstance(sweep, RangeSweep):
        start, stop, step = sweep.start, sweep.stop, sweep.step
        if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
            last = start + (stop - 1 - start) // step * step  # stop is excluded
            return IntDistribution(start, last, step=step)
    if isinstance(sweep, IntervalSweep):
        assert sweep.start is not None and sweep.end is not None
        if "int" in sweep.tags:
            return IntDistribution(int(sweep.start), int(sweep.end), log="log" in sweep.tags)
        return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
    raise ValueError(
        f"{override.input_line}: an Optuna search space takes choice(...) of plain values, an integer "
        f"range(...) or interval(...) (tag(log, ...) for a log scale)"
    )


def check_same_study(study: Any, space: dict[str, Any], direction: str, storage: str) -> None:
    """Refuse to continue a study with another search space or direction: its trials would not compare."""
    previous = next((trial.distributions for trial in study.trials if trial.distributions), None)
    if previous is not None and previous != space:
        raise ValueError(
            f"the study in {storage} was searched over {sorted(previous.items())}, not {sorted(space.items())}: "
            f"keep its search space to continue it, or start another study with hydra.sweep.dir=<a new directory>"
        )
    if study.direction.name.lower() != direction:
        raise ValueError(
            f"the study in {storage} was run to {study.direction.name.lower()}, not to {direction}: "
            f"keep hydra.sweeper.direction, or start another study with hydra.sweep.dir=<a new directory>"
        )


def report_best(study: Any, storage: str) -> None:
    import optuna

    if not study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        raise RuntimeError(
            f"no trial of study {study.study_name} ({storage}) has completed: "
            f"see each trial's status.json in the sweep directory for its error"
        )
    best = study.best_trial
    log.info(f"best trial {best.number}: {best.value} with {best.params}")
