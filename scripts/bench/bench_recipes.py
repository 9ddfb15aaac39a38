"""The modern presets against their `_tiny` counterparts: the same data, tokens, steps and seeds.

For each objective and seed, both presets train with the real `pretrain` command, validating every
`--every` steps. Printed per pair:

- each run's final metric (at the preset's `trainer.max_steps`: the same steps, batch and block size, so
  the same tokens) and its spread over the seeds;
- the first validated step at which the modern preset reaches the `_tiny` run's final metric, as a share
  of the `_tiny` run's steps, and the training time to that step against the `_tiny` run's whole training
  time (the sum of `perf/step_time` over the steps: start-up and validation left out of both).

    .venv/bin/python scripts/bench/bench_recipes.py --objectives clm --seeds 1234 1
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    baseline: str
    modern: str
    metric: str
    higher_is_better: bool


PAIRS = {
    "clm": Pair("clm_tiny", "clm_modern", "val/bpb", higher_is_better=False),
    "mlm": Pair("mlm_tiny", "mlm_modern", "val/accuracy_mask", higher_is_better=True),
}


@dataclass(frozen=True)
class Curve:
    """A run's validated metric by step, its training seconds by step, and its whole wall time."""

    metric: dict[int, float]
    train_seconds: dict[int, float]
    wall_seconds: float

    @property
    def final(self) -> float:
        return self.metric[max(self.metric)]

    def seconds_to(self, step: int) -> float:
        return max(seconds for logged, seconds in self.train_seconds.items() if logged <= step)


def train(log_dir: Path, experiment: str, seed: int, every: int, metric: str, overrides: list[str]) -> Curve:
    run = f"{experiment}-{seed}"
    command = [
        sys.executable, "-m", "pretraining", f"experiment={experiment}", f"seed={seed}", f"run_name={run}",
        f"paths.log_dir={log_dir}", "logger=csv", f"trainer.val_check_interval={every}",
        "~callbacks.text_sample", *overrides,
    ]  # fmt: skip
    print(f"training {run}: {' '.join(command[3:])}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    return read_curve(log_dir / "train" / "runs" / run / "csv" / "metrics.csv", metric, wall)


def read_curve(path: Path, metric: str, wall: float) -> Curve:
    """A run's curve from its CSV log: `metric` at each validation after step 0, and the training seconds
    to each logged step (`perf/step_time` times the steps since the previous log)."""
    with path.open() as file:
        rows = list(csv.DictReader(file))
    values = {int(float(row["step"])): float(row[metric]) for row in rows if row.get(metric)}
    values.pop(0, None)  # the untrained model's validation
    seconds, total, last = {}, 0.0, 0
    for row in rows:
        if row.get("perf/step_time"):
            step = int(float(row["step"]))
            total += float(row["perf/step_time"]) * (step - last)
            seconds[step], last = total, step
    return Curve(values, seconds, wall)


def reached(curve: Curve, target: float, higher_is_better: bool) -> int | None:
    """The first validated step at which `curve` is at `target` or better."""
    for step in sorted(curve.metric):
        value = curve.metric[step]
        if (value >= target) if higher_is_better else (value <= target):
            return step
    return None


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} (from {min(values):.3f} to {max(values):.3f})"


def compare(pair: Pair, seeds: list[int], every: int, log_dir: Path, overrides: list[str]) -> None:
    baselines, moderns = [], []
    for seed in seeds:
        baseline = train(log_dir, pair.baseline, seed, every, pair.metric, overrides)
        modern = train(log_dir, pair.modern, seed, every, pair.metric, overrides)
        baselines.append(baseline)
        moderns.append(modern)
        steps = max(baseline.metric)
        step = reached(modern, baseline.final, pair.higher_is_better)
        print(f"\n{pair.modern} against {pair.baseline}, seed {seed}, {pair.metric} every {every} steps")
        print(f"   final at step {steps}: {pair.baseline} {baseline.final:.4f}, {pair.modern} {modern.final:.4f}")
        print(f"   whole runs: {baseline.wall_seconds:.0f} s and {modern.wall_seconds:.0f} s")
        if step is None:
            print(f"   {pair.modern} never reached {baseline.final:.4f}")
            continue
        time_share = modern.seconds_to(step) / baseline.seconds_to(steps)
        print(
            f"   {pair.modern} reached {baseline.final:.4f} at step {step} ({step / steps:.2f}x the steps), "
            f"after {modern.seconds_to(step):.0f} s of training against {baseline.seconds_to(steps):.0f} s "
            f"({time_share:.2f}x the time)"
        )
    finals = [run.final for run in baselines], [run.final for run in moderns]
    margins = [modern - baseline for baseline, modern in zip(*finals, strict=True)]
    print(f"\n{pair.metric} over seeds {seeds}: {pair.baseline} {spread(finals[0])}, {pair.modern} {spread(finals[1])}")
    print(f"   margin (modern - baseline) {spread(margins)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objectives", nargs="+", choices=sorted(PAIRS), default=sorted(PAIRS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 1])
    parser.add_argument("--every", type=int, default=50, help="validate every this many steps")
    parser.add_argument("--log-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (data.dir=...)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        log_dir = args.log_dir or Path(temporary)
        for objective in args.objectives:
            compare(PAIRS[objective], args.seeds, args.every, log_dir, args.overrides)


if __name__ == "__main__":
    main()
