"""The bundled suite's scores of trained checkpoints and of the same models untrained, with 95 % bootstrap intervals.

    .venv/bin/python scripts/bench/bench_evals.py CKPT [CKPT ...] [--suite data/evals] [--tasks NAME ...]
        [--limit N] [--resamples 2000]

For each checkpoint, every task of the suite its objective runs unnamed (`pretraining.extras.evals.callback.SCORED`),
or those of `--tasks` it scores, on at most `--limit` items each, run as the evaluation extra runs it in the loop:
on the checkpoint's weights, and on the weights its run started from (its stored config built again after
seeding with the run's seed, as `pretrain` builds it: the step-0 scores). Each score comes with a 95 % percentile
interval: the items drawn with replacement `--resamples` times (seed 0), a harness task's documents, a retrieval
task's queries, a masked-tokens task's texts (its accuracy is a ratio of sums over the drawn texts). Prints a
Markdown table (docs/evals.md, "Scores of the default presets").
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import seed_everything

from pretraining.errors import PretrainingError
from pretraining.extras.evals.callback import make_task, read_suite, scored_kinds
from pretraining.extras.evals.harness import HarnessTask
from pretraining.extras.evals.masked_tokens import MaskedTokenTask
from pretraining.extras.evals.retrieval import RetrievalTask
from pretraining.extras.evals.task import SUITE_FILE
from pretraining.objectives.base import PretrainingObjective, build_objective
from pretraining.stored import load_checkpoint, rebuilding, stored_model

RESAMPLES = 2000
HARNESS_METRICS = ("acc", "acc_norm")
# Per item: the numerator and denominator of each metric (a mean: a denominator of 1).
Terms = dict[str, tuple[np.ndarray, np.ndarray]]


def harness_terms(task: HarnessTask, model: PretrainingObjective) -> Terms:
    samples = task.run(model, log_samples=True)["samples"][task.name]
    ones = np.ones(len(samples))
    return {metric: (np.array([float(sample[metric]) for sample in samples]), ones) for metric in HARNESS_METRICS}


def retrieval_terms(task: RetrievalTask, model: PretrainingObjective) -> Terms:
    return {name: (values.numpy(), np.ones(len(values))) for name, values in task.per_query(model).items()}


def masked_token_terms(task: MaskedTokenTask, model: PretrainingObjective) -> Terms:
    correct, selected, masked_correct, masked = (
        np.array([getattr(count, field) for count in task.counts(model)], dtype=float)
        for field in ("correct", "selected", "masked_correct", "masked")
    )
    return {"accuracy": (correct, selected), "accuracy_mask": (masked_correct, masked)}


TERMS = {"harness": harness_terms, "retrieval": retrieval_terms, "masked_tokens": masked_token_terms}


def interval(numerator: np.ndarray, denominator: np.ndarray, resamples: int) -> tuple[float, float, float]:
    """The ratio of sums and its 95 % percentile bootstrap interval over the items (seed 0)."""
    drawn = np.random.default_rng(0).integers(0, len(numerator), (resamples, len(numerator)))
    ratios = numerator[drawn].sum(1) / denominator[drawn].sum(1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(numerator.sum() / denominator.sum()), float(low), float(high)


def suite_tasks(
    suite: Path, model: PretrainingObjective, examples: Any, names: list[str] | None, limit: int | None
) -> list[tuple[str, Any, Any]]:
    """(name, task, its per-item scorer) of the suite tasks `model` runs unnamed, or of those in `names` it
    scores, checked as the callback checks them."""
    kinds, default = scored_kinds(model)
    tasks = []
    for name, entry in read_suite(suite).items():
        if entry["kind"] not in (default if names is None else kinds) or (names is not None and name not in names):
            continue
        task = make_task(name, entry["kind"], [suite / name], examples, limit=limit)
        task.check(model)
        tasks.append((name, task, TERMS[entry["kind"]]))
    return tasks


def untrained(checkpoint: dict[str, Any], run: Any, source: str, examples: Any) -> PretrainingObjective:
    """The model `checkpoint`'s run started from: seeded as `pretrain` seeds, then built from the stored config."""
    seed_everything(run.seed, verbose=False)
    with rebuilding(checkpoint, source):
        return build_objective(run.model, examples)


def rows(path: str, suite: Path, chance: dict[str, dict[str, float]], args: argparse.Namespace) -> list[str]:
    """The table's rows of one checkpoint: each task's metrics, chance, untrained and trained."""
    checkpoint = load_checkpoint(path)
    trained, run, examples = stored_model(checkpoint, path)
    models = {"untrained": untrained(checkpoint, run, path, examples), "trained": trained}
    preset = f"{' '.join(run.get('tags') or ['-'])} ({checkpoint['global_step']} steps)"
    out = []
    for name, task, terms in suite_tasks(suite, trained, examples, args.tasks, args.limit):
        scores: dict[str, dict[str, str]] = {}
        for label, model in models.items():
            model.eval()
            with torch.no_grad():
                for metric, (numerator, denominator) in terms(task, model).items():
                    value, low, high = interval(numerator, denominator, args.resamples)
                    scores.setdefault(metric, {})[label] = f"{value:.3f} ({low:.3f} to {high:.3f})"
                    items = len(numerator)
        for metric, by_model in scores.items():
            expected = chance[name].get(metric)
            shown = f"{expected:.3f}" if expected is not None else "-"
            untrained_score, trained_score = by_model["untrained"], by_model["trained"]
            out.append(f"| {preset} | {name} | {items} | {metric} | {shown} | {untrained_score} | {trained_score} |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="the checkpoints to score (a run's last.ckpt, say)")
    parser.add_argument("--suite", type=Path, default=Path("data/evals"), help="the suite (default: %(default)s)")
    parser.add_argument("--tasks", nargs="+", help="the tasks to run (default: those each objective runs unnamed)")
    parser.add_argument("--limit", type=int, help="at most this many items a task (default: all)")
    parser.add_argument("--resamples", type=int, default=RESAMPLES, help="of the bootstrap (default: %(default)s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        chance = {name: entry["chance"] for name, entry in read_suite(args.suite).items()}
        table = [line for path in args.checkpoints for line in rows(path, args.suite, chance, args)]
    except PretrainingError as error:  # a missing suite or checkpoint, a task the model cannot score
        raise SystemExit(f"bench_evals: {error}") from None
    suite = json.loads((args.suite / SUITE_FILE).read_text())["source"]
    print(
        f"the suite of {suite['data_dir']} (data {suite['data_version']}), seed {suite['seed']}; 95 % bootstrap "
        f"intervals over the items ({args.resamples} resamples, seed 0); {time.perf_counter() - start:.0f} s\n"
    )
    print("| preset | task | items | metric | chance | untrained (step 0) | trained |\n|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
