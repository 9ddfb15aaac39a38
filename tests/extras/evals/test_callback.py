"""`DownstreamEvals` in runs: which validations it evaluates (by the step: a resumed run neither repeats nor
skips one), its refusals before any step, its time (the summary, the checkpoint, the goodput record) and
`pretrain-eval ... callbacks=evals`. A fake task (a score of the model's features, shared over ranks as the real
tasks share theirs) stands in for the real ones, which their own tests score."""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.evaluate import evaluate
from pretraining.extras.evals.build import build_suite
from pretraining.extras.evals.callback import DownstreamEvals
from pretraining.extras.evals.task import gathered, share
from pretraining.objectives.base import PretrainingObjective
from pretraining.train import train

SUITE_ITEMS = 16  # items a task of the bundled suite built by the tests
SLEEP = 0.2  # seconds each fake evaluation takes at least: a measurable time
# Validations every 3 steps to 15; evaluations every 2 of those intervals (0, 6, 12) and at the last step.
SCHEDULE = ["trainer.max_steps=15", "trainer.val_check_interval=3", "callbacks.checkpoint.every_n_steps=3"]
EVALUATED = [0, 6, 12, 15]
TARGET = "evals.test_callback.FakeEvals"  # this file, importable by this name (pytest's pythonpath: tests/extras)


class FakeTask:
    """A task of a few fixed token sequences: the mean of the model's pooled features over them (`score`), from
    the items this rank was dealt (`share`) gathered back (`gathered`), as the real tasks compute theirs."""

    bar_said: ClassVar[list[str]] = []  # the validation progress bar's description while it ran

    def __init__(self, name: str, signal_at: int | None) -> None:
        self.name, self.signal_at = name, signal_at
        self.items = [[(7 * i + j) % 200 + 10 for j in range(5 + i % 4)] for i in range(9)]

    def check(self, model: PretrainingObjective) -> None:
        """Nothing to check: every objective has features."""

    def evaluate(self, model: PretrainingObjective) -> dict[str, float]:
        assert not model.training and not torch.is_grad_enabled()  # frozen by the callback
        bar = model.trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            FakeTask.bar_said.append(bar.val_progress_bar.desc)
        results = []
        for batch in share(self.items, 2):
            longest = max(map(len, batch))
            tokens = torch.tensor([row + [0] * (longest - len(row)) for row in batch], device=model.device)
            attend = torch.arange(longest, device=model.device) < torch.tensor([len(r) for r in batch]).unsqueeze(1)
            results += model.features(tokens, attend.to(model.device)).mean(1).tolist()
        scores = gathered(results, len(self.items))
        if model.trained_steps == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's notice during the evaluation
        time.sleep(SLEEP)
        return {"score": sum(scores) / len(scores), "items": float(len(scores))}


class FakeEvals(DownstreamEvals):
    """`DownstreamEvals` building `FakeTask`s for the suite's task names, whatever their kind."""

    def __init__(self, signal_at: int | None = None, **settings: Any) -> None:
        super().__init__(**settings)
        self.signal_at = signal_at

    def make_task(self, name: str, kind: str, folders: list[Path], trainer: Trainer) -> Any:
        assert folders == [self.suite / name]
        return FakeTask(name, self.signal_at)


class SignalInValidation(Callback):
    """SIGTERM to this process in the first validation batch of step `step` (the validation is then cut short)."""

    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if not self.sent and not trainer.sanity_checking and pl_module.trained_steps == self.step:  # type: ignore[attr-defined]
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def write_suite(directory: Path) -> Path:
    """A suite.json of one task of each kind (their files are the fake's business)."""
    directory.mkdir(parents=True, exist_ok=True)
    tasks = {
        "fake_choice": {"kind": "harness", "items": 9},
        "fake_retrieval": {"kind": "retrieval", "items": 9},
        "fake_masked": {"kind": "masked_tokens", "items": 9},
    }
    (directory / "suite.json").write_text(json.dumps({"version": 1, "tasks": tasks}))
    return directory


def evals(suite: Path, *settings: str, fake: bool = True, group: str = "[default,evals]") -> list[str]:
    """Overrides adding the callback (`FakeEvals` if `fake`) on `suite`, with the callback groups `group`."""
    target = [f"callbacks.evals._target_={TARGET}"] if fake else []
    return [f"callbacks={group}", f"callbacks.evals.suite={suite}", *target, *settings]


def eval_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as file:
        return [row for row in csv.DictReader(file) if row.get("eval/fake_choice/score")]


def test_evaluations_are_logged_at_the_steps_due_and_their_time_is_reported(
    compose_train, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    suite = write_suite(tmp_path / "suite")
    every_2 = "callbacks.evals.every_n_validations=2"
    metrics = train(compose_train(*SCHEDULE, *evals(suite, every_2, group="[default,evals,goodput]")))
    rows = eval_rows(tmp_path)
    assert [int(row["step"]) for row in rows] == EVALUATED
    assert all(row["val/loss"] and float(row["eval/fake_choice/items"]) == 9 for row in rows)  # the validation's row
    assert "eval/fake_retrieval/score" not in rows[0] and "eval/fake_masked/score" not in rows[0]  # not a CausalLM's
    assert rows[0]["eval/fake_choice/score"] != rows[-1]["eval/fake_choice/score"]  # the live model's
    assert metrics["eval/fake_choice/score"] == pytest.approx(float(rows[-1]["eval/fake_choice/score"]))
    printed = caplog.text  # the template's messages go through logging
    assert "downstream eval at step 6: fake_choice score" in printed and "downstream eval at step 3" not in printed
    assert "downstream evaluation: " in printed and "% of the run's wall time" in printed
    built = importlib.import_module(TARGET.rsplit(".", 1)[0]).FakeTask  # Hydra's import of this file, by that name
    assert built.bar_said[-1].startswith("Evaluating fake_choice")
    # The goodput record books the evaluations apart from the validations they ran in.
    last = json.loads((tmp_path / "goodput.jsonl").read_text().splitlines()[-1])
    assert last["spent"]["evaluation"] >= len(EVALUATED) * SLEEP > 0
    assert last["spent"]["validation"] < last["spent"]["evaluation"] * 10

    # pretrain-eval scores a checkpoint with the callbacks named on its command line.
    checkpoint = tmp_path / "checkpoints" / "step-000015.ckpt"
    scoring = evals(suite, group="evals")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "eval",
            overrides=[f"ckpt_path={checkpoint}", f"paths.output_dir={tmp_path / 'eval'}", "prompt=''", *scoring],
        )
    (tmp_path / "eval").mkdir()
    result = evaluate(cfg)
    scored = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert scored["eval/fake_choice/score"] == pytest.approx(metrics["eval/fake_choice/score"], rel=1e-5)
    assert result["eval/fake_choice/items"] == 9
    assert "eval/fake_choice/score: " in "".join(capsys.readouterr())


def test_a_run_stopped_in_and_after_validations_evaluates_each_step_due_once(compose_train, tmp_path: Path) -> None:
    """Stopped by SIGTERM in the validation of step 3 (it is validated again on resume: not evaluated), during the
    evaluation of step 6 (it completes, and step 7 is saved), then in the validation of step 12 (validated and
    evaluated again on resume): each step due is evaluated once, none is skipped."""
    suite = write_suite(tmp_path / "suite")
    settings = [*SCHEDULE, *evals(suite, "callbacks.evals.every_n_validations=2")]
    interrupt = ["+callbacks.cut._target_=evals.test_callback.SignalInValidation"]
    for stop in (
        [*interrupt, "+callbacks.cut.step=3"],
        ["+callbacks.evals.signal_at=6"],
        [*interrupt, "+callbacks.cut.step=12"],
    ):
        with pytest.raises(SystemExit) as stopped:
            train(compose_train(*settings, *stop))
        assert stopped.value.code == 128 + signal.SIGTERM
    train(compose_train(*settings))
    assert [int(row["step"]) for row in eval_rows(tmp_path)] == EVALUATED
    state = torch.load(tmp_path / "checkpoints" / "step-000015.ckpt", weights_only=False)["callbacks"]["FakeEvals"]
    assert state["seconds"] >= len(EVALUATED) * SLEEP and state["wall_seconds"] > state["seconds"]  # over the attempts


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ([], r"callbacks\.evals\.suite=.*missing: no suite\.json there: build the bundled suite with `make evals`"),
        (["callbacks.evals.tasks=[nope]"], r"evals\.tasks names 'nope'.*its tasks: fake_choice, fake_masked"),
        (["callbacks.evals.tasks=[fake_retrieval]"], r"'fake_retrieval', a retrieval task, which a CausalLM does not"),
        (["callbacks.evals.every_n_validations=0"], r"callbacks\.evals\.every_n_validations"),
    ],
    ids=["missing-suite", "unknown-task", "kind-not-scored", "every-0"],
)
def test_bad_settings_are_refused_in_one_line_before_any_step(
    compose_train, tmp_path: Path, settings: list[str], refusal: str
) -> None:
    suite = write_suite(tmp_path / "suite") if settings else tmp_path / "missing"
    with pytest.raises(ConfigError, match=refusal) as refused:
        train(compose_train(*evals(suite, *settings, fake=False)))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def bundled_suite(shard_dir: Path, pair_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled suite (`pretrain-evals build`) of the test shards, a few items a task."""
    out = tmp_path_factory.mktemp("suite") / "evals"
    build_suite(shard_dir, pair_dir, out, items=SUITE_ITEMS)
    return out


HARNESS = {"stdlib_next_line": "acc", "stdlib_function_name": "acc_norm"}
# Each objective's tasks of the bundled suite (those it runs unnamed, or those named), and a metric of each.
SCORED_TASKS = [
    ("clm_tiny", None, HARNESS),
    ("mlm_tiny", None, {"stdlib_heldout_text": "accuracy"}),
    (
        "mlm_tiny",
        ["stdlib_next_line", "stdlib_heldout_text"],
        {"stdlib_next_line": "acc", "stdlib_heldout_text": "accuracy"},
    ),
    ("contrastive_tiny", None, {"stdlib_docstring_code": "ndcg@10"}),
]


@pytest.mark.parametrize(("experiment", "named", "scored"), SCORED_TASKS)
def test_each_objective_scores_the_bundled_tasks_of_its_kinds(
    compose_train, tmp_path: Path, bundled_suite: Path, experiment: str, named: list[str] | None, scored: dict
) -> None:
    short = ["trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_steps=2"]
    short.append("model.backbone.max_seq_len=320")  # the longest choice of the bundled items (256 bytes) fits
    settings = ["callbacks.evals.limit=8", *([f"callbacks.evals.tasks=[{','.join(named)}]"] if named else [])]
    run = compose_train(*short, *evals(bundled_suite, *settings, fake=False), experiment=experiment)
    scores = {key.removeprefix("eval/"): value for key, value in train(run).items() if key.startswith("eval/")}
    assert {key.split("/")[0] for key in scores} == set(scored)
    assert all(0 <= scores[f"{task}/{metric}"] <= 1 for task, metric in scored.items())
    assert {
        int(row["step"])
        for row in csv.DictReader((tmp_path / "csv" / "metrics.csv").open())
        if any(key.startswith("eval/") and value for key, value in row.items())
    } == {0, 2}
