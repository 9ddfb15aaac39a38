"""One lm-evaluation-harness task, read from local task folders, scored on the live next-token or masked-LM model.

`HarnessTask.check` refuses at setup, in one line each, what would fail (or download, or run code) mid-run: an
unknown task, a malformed YAML, a dataset that is not local files, a `!function` not trusted, an unknown metric, a
request type the model cannot score, a continuation (or a generation) longer than the model's context, and
whatever else lm_eval refuses as it builds the task's requests (a template naming a missing field, say).
`evaluate` runs lm_eval's own evaluator (its metrics and aggregation) on `lm.LiveLM`, offline, quietly and with
the task's templates in Jinja's sandbox (`guarded`).
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import datasets
import lm_eval.api.metrics  # fills the metric registry
import lm_eval.utils
import yaml
from jinja2 import BaseLoader, StrictUndefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from lm_eval.api.registry import METRIC_REGISTRY
from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError
from pretraining.extras.evals.lm import LiveLM
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM

LOCAL_BUILDERS = ("json", "csv", "text", "parquet")
MASKED_LM_OUTPUT_TYPES = ("loglikelihood", "multiple_choice")
BOOTSTRAP_ITERS = 1000  # lm_eval's stderr of a mean is closed-form; bootstrapped metrics get a cheap estimate
TRUST_KEY = "callbacks.evals.trust_task_code"


class HarnessTask:
    """The lm-evaluation-harness task `name`, found in the task YAMLs of `task_dirs`, scored `batch_size` sequences
    a forward on at most `limit` documents. `trust_task_code` lets its YAML import Python (`!function`)."""

    def __init__(
        self,
        name: str,
        task_dirs: Sequence[Path],
        tokenizer: Tokenizer,
        batch_size: int = 16,
        limit: int | None = None,
        trust_task_code: bool = False,
    ) -> None:
        self.name, self.task_dirs, self.tokenizer = name, [Path(d) for d in task_dirs], tokenizer
        self.batch_size, self.limit, self.trust_task_code = batch_size, limit, trust_task_code
        self.loaded: dict[str, Any] | None = None  # lm_eval's task dict: its requests are rebuilt at every run

    def check(self, model: PretrainingObjective) -> None:
        """Refuse, in one line naming the file (and line) or key, what would stop the task mid-run."""
        path = self.yaml_path()
        config = read_task_yaml(path, self.trust_task_code)
        check_local_data(self.name, config, path)
        check_metrics(config, path, self.trust_task_code)
        check_output_type(self.name, config, model)
        try:
            self.check_requests(model)
        except ConfigError:
            raise
        except Exception as error:  # lm_eval's refusal of the task, or of a document by its templates
            reason = (str(error).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"{path}: lm_eval cannot build the requests of task {self.name} ({type(error).__name__}: {reason}): "
                "fix the YAML or its data"
            ) from None

    def evaluate(self, model: PretrainingObjective) -> dict[str, float]:
        """The task's aggregated metrics (acc, acc_norm, their stderr, ...), the same on every rank."""
        return numeric_metrics(self.run(model)["results"][self.name])

    def run(self, model: PretrainingObjective, log_samples: bool = False) -> dict[str, Any]:
        """lm_eval's results of the task on `model` (with every document's requests and scores if `log_samples`)."""
        lm = LiveLM(scorable(model), self.tokenizer, self.batch_size)
        tasks = self.tasks()
        with guarded(), quiet_harness():
            results = evaluate(lm, tasks, limit=self.limit, bootstrap_iters=BOOTSTRAP_ITERS, log_samples=log_samples)
        assert results is not None  # lm_eval is told it is rank 0 of 1
        return dict(results)

    def tasks(self) -> dict[str, Any]:
        """lm_eval's task dict, loaded once (offline): loading reads the dataset, a run only builds requests."""
        if self.loaded is None:
            with guarded(), quiet_harness():
                self.loaded = self.task_manager().load([self.name])
        return self.loaded

    def task_manager(self) -> TaskManager:
        """lm_eval's index of the task YAMLs in `task_dirs` only (indexing reads YAML and runs no code)."""
        for folder in self.task_dirs:
            if not folder.is_dir():
                raise ConfigError(
                    f"task folder {folder} not found: fix callbacks.evals.include, or (a task of the bundled suite) "
                    "build the suite with `pretrain-evals build`"
                )
        return TaskManager(include_path=[str(d) for d in self.task_dirs], include_defaults=False)

    def yaml_path(self) -> Path:
        """The YAML file of the task, refused if the name is unknown or not a single task."""
        index = self.task_manager().task_index
        entry = index.get(self.name)
        if entry is None:
            for folder in self.task_dirs:  # a malformed YAML is left out of lm_eval's index without a word
                for path in sorted(folder.glob("**/*.yaml")):
                    read_task_yaml(path, trust_task_code=True)
            known = ", ".join(sorted(index)[:5]) or "none"
            raise ConfigError(
                f"callbacks.evals.tasks: no task {self.name!r} in {', '.join(map(str, self.task_dirs))} "
                f"(known: {known}): name one of them"
            )
        if entry.yaml_path is None or "task" not in (entry.cfg or {}):
            raise ConfigError(f"callbacks.evals.tasks: {self.name!r} is a group or tag: name its tasks one by one")
        return Path(entry.yaml_path)

    def check_requests(self, model: PretrainingObjective) -> None:
        """Build the task's requests (as a run does) and refuse a continuation that alone overflows the model's
        context (a long context is left-truncated), or a generation that leaves no room for one."""
        lm = TokenPairs(scorable(model), self.tokenizer, self.batch_size)
        task = next(iter(self.tasks()["tasks"].values()))
        with guarded(), quiet_harness():
            task.build_all_requests(limit=self.limit, rank=0, world_size=1)
        for instance in task.instances:
            if instance.request_type == "generate_until":
                lm.generation_settings(instance.args[1])
        scored = [instance for instance in task.instances if instance.request_type == "loglikelihood"]
        lm.loglikelihood(scored)
        for instance, (_, continuation) in zip(scored, lm.pairs, strict=True):
            if len(continuation) > lm.max_length:
                raise ConfigError(
                    f"task {self.name}, document {instance.doc_id}: a choice of {len(continuation)} tokens exceeds "
                    f"model.backbone.max_seq_len={lm.max_length} and cannot be scored: shorten it, or drop the task"
                )


class TokenPairs(LiveLM):
    """A `LiveLM` that keeps the (context, continuation) tokens lm_eval makes of its log-likelihood requests
    (`TemplateLM`'s split) instead of scoring them: what `check_requests` measures."""

    pairs: list[tuple[list[int], list[int]]]

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any) -> list[Any]:
        self.pairs = [(context, continuation) for _, context, continuation in requests]
        return [(0.0, False)] * len(requests)


def scorable(model: PretrainingObjective) -> CausalLM | MaskedLM:
    """`model` if harness tasks can score it: next-token and masked-LM models."""
    if not isinstance(model, CausalLM | MaskedLM):
        raise ConfigError(
            f"callbacks.evals.tasks: harness tasks score next-token and masked-LM models, not {type(model).__name__}: "
            "give a contrastive model retrieval tasks"
        )
    return model


def read_task_yaml(path: Path, trust_task_code: bool, including: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A task YAML's settings, its `include:`s merged in as lm_eval merges them, read as plain data: a `!function`
    (which would import Python from the task's folder) is refused unless `trust_task_code`. `including`: the
    files whose includes lead here (a file among them is a cycle)."""
    if path.resolve() in including:
        raise ConfigError(f"{path}: included by itself ({' -> '.join(map(str, including))}): remove the cycle")
    loader = task_yaml_loader(path, trust_task_code)
    try:
        config = yaml.load(path.read_text(), Loader=loader)  # a SafeLoader: plain data only
    except OSError as error:
        raise ConfigError(f"task file {path} cannot be read ({error.strerror}): restore it") from None
    except yaml.MarkedYAMLError as error:
        line = error.problem_mark.line + 1 if error.problem_mark else "?"
        raise ConfigError(f"{path}:{line}: not valid YAML ({error.problem}): fix the file") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a task YAML must be a mapping of settings: fix the file")
    includes = config.pop("include", [])
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        merged |= read_task_yaml(path.parent / include, trust_task_code, (*including, path.resolve()))
    return merged | config


class TaskFunction(str):
    """The name a trusted `!function` gives (lm_eval imports it): a metric named so is the task's own."""


def task_yaml_loader(path: Path, trust_task_code: bool) -> type[yaml.SafeLoader]:
    """YAML's safe loader (plain data only), with lm_eval's `!function` tag read as a name, never imported here."""

    def function(loader: yaml.SafeLoader, node: yaml.Node) -> TaskFunction:
        name = loader.construct_scalar(node)  # type: ignore[arg-type]
        if not trust_task_code:
            raise ConfigError(
                f"{path}:{node.start_mark.line + 1}: `!function {name}` would import Python from the task's folder: "
                f"remove it, or set {TRUST_KEY}=true if you trust that code"
            )
        return TaskFunction(name)

    class TaskYamlLoader(yaml.SafeLoader):
        pass

    TaskYamlLoader.add_constructor("!function", function)
    return TaskYamlLoader


def check_local_data(name: str, config: dict[str, Any], path: Path) -> None:
    """Refuse a dataset that is not local files of a packaged builder, a missing file or a jsonl line not JSON.
    Relative paths are read from the working directory, as lm_eval (`datasets`) reads them."""
    builder = config.get("dataset_path")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if builder not in LOCAL_BUILDERS or not files:
        raise ConfigError(
            f"{path}: task {name} would download dataset {builder!r} from the Hugging Face Hub: give it local files "
            "(dataset_path: json, dataset_kwargs: {data_files: ...})"
        )
    listed = files.values() if isinstance(files, dict) else [files]
    for entry in listed:
        for pattern in [entry] if isinstance(entry, str) else entry:
            matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]  # datasets reads globs
            if not matches:
                raise ConfigError(f"{path}: no data file matches {pattern} (read from {Path.cwd()}): fix data_files")
            for file in matches:
                check_data_file(Path(file), path)


def check_data_file(file: Path, task_file: Path) -> None:
    """Refuse a missing data file, or a jsonl one with a line that is not JSON (naming the file and line)."""
    if not file.is_file():
        raise ConfigError(
            f"{task_file}: data file {file} not found (a relative path is read from {Path.cwd()}): restore it, "
            "or rebuild the suite with `pretrain-evals build`"
        )
    if file.suffix != ".jsonl":
        return
    with file.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                if line.strip():
                    json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{file}:{number}: not JSON ({error.msg}): fix or remove the line") from None


def check_metrics(config: dict[str, Any], path: Path, trust_task_code: bool) -> None:
    """Refuse a metric lm_eval's registry lacks: lm_eval would look for it on the Hub (Hugging Face `evaluate`)."""
    if config.get("process_results") is not None:  # the task's own code computes its metrics
        return
    for entry in config.get("metric_list") or []:
        metric = entry.get("metric") if isinstance(entry, dict) else None
        if trust_task_code and isinstance(metric, TaskFunction):  # the task's own function
            continue
        downloaded = isinstance(entry, dict) and entry.get("hf_evaluate") is True
        if downloaded or (isinstance(metric, str) and metric not in METRIC_REGISTRY):
            raise ConfigError(
                f"{path}: metric {metric!r} is not one of lm_eval's ({', '.join(sorted(METRIC_REGISTRY))}) and would "
                "be downloaded: choose one of those"
            )


def check_output_type(name: str, config: dict[str, Any], model: PretrainingObjective) -> None:
    """Refuse a request type the model cannot score: a masked-LM scores (pseudo-)log-likelihoods only."""
    output_type = config.get("output_type", "generate_until")
    if isinstance(scorable(model), MaskedLM) and output_type not in MASKED_LM_OUTPUT_TYPES:
        raise ConfigError(
            f"callbacks.evals.tasks: task {name} is {output_type}, which needs a next-token model, and this one is a "
            f"masked-LM (it scores {' and '.join(MASKED_LM_OUTPUT_TYPES)} tasks): leave the task out"
        )


def numeric_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm_eval's `metric,filter` entries as floats (`metric` where the filter is `none`), "N/A" left out."""
    metrics = {}
    for key, value in results.items():
        metric, _, filter_name = key.partition(",")
        if filter_name and isinstance(value, int | float) and not isinstance(value, bool):
            metrics[metric if filter_name == "none" else f"{metric}_{filter_name}"] = float(value)
    return metrics


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """lm_eval inside the training process: no download can start (`datasets` reads its offline switch once, at
    import, so it is set too); a bootstrapped stderr is computed in this process (lm_eval's default is a pool of a
    process per CPU, forked from every rank); a task's Jinja templates (`doc_to_text`, ...) render in Jinja's
    sandbox, where they cannot reach Python (lm_eval renders them unsandboxed: `{{ cycler.__init__.__globals__ }}`)."""
    variables = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "DISABLE_MULTIPROC": "1"}
    sandbox = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandbox.filters.update(lm_eval.utils.env.filters)  # lm_eval's own (regex_replace)
    with (
        mock.patch.dict(os.environ, variables),
        mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True),
        mock.patch.object(lm_eval.utils, "env", sandbox),
    ):
        yield


@contextlib.contextmanager
def quiet_harness() -> Iterator[None]:
    """lm_eval's and `datasets`' INFO lines and progress bars (lm_eval's cannot be switched off) left out."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
