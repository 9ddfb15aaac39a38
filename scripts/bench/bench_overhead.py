"""Template overhead vs a plain PyTorch loop with the same safety, and loader vs model throughput (CPU, one process).

1. The clm_tiny run as `pretrain` builds it (`pretraining.run.build_trainer`: the default callbacks and the CSV
   logger; the DataModule and its loader; a validation before training and after the last step) against the loop a
   careful user writes by hand: zero_grad, loss, backward, clip_grad_norm_(1.0), a check that loss and norm are
   finite (a bad step is skipped), optimizer.step, scheduler.step, over the same batches read ahead. The two run in
   lockstep on separate copies of the model: at the start of Lightning's step i a callback runs plain step i (timed
   on its own), so both see the same machine state and the slow drift of a shared machine cancels out. Lightning's
   step i is everything from the end of plain step i to the start of plain step i+1: its hooks, callbacks, logging,
   LR scheduler and the fetching of the next batch from its loader. The first `--warmup` steps are left out; the
   step times are medians over all timed steps of all runs, and `template / plain` is the median of the per-step
   ratios: goal <= 1.03; the ratio of the mean step times follows (the steps that write logs included). Each
   callback's hooks are timed in the timed steps too (its cost per step and its share of the mean step: the goodput
   extra's accounting, goal < 0.2 %), and the run's fixed costs: before the
   first step (the Trainer's set-up, the first validation) and after the last (the last
   validation, the text sample, the final checkpoint).
2. Both models start from the same weights; after N steps every parameter must be bitwise equal (`torch.equal`).
3. The training DataLoader (default num_workers) must deliver tokens at >= 10x the rate the model consumes them.

    python scripts/bench/bench_overhead.py --data data/stdlib [--steps 50 --repeats 2 --threads 1] [-- hydra overrides]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from pretraining.callbacks.data_counts import DataCounts
from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.objectives.base import PretrainingObjective, build_objective
from pretraining.run import build_trainer, fit, prepare_process, run_lineage

Batch = dict[str, torch.Tensor]
# The hooks a callback may run inside a training step.
STEP_HOOKS = [
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
]


class PlainLoop:
    """One training step as a careful user writes it, with the objective's own optimizer and schedule."""

    def __init__(self, model: PretrainingObjective, steps: int) -> None:
        # configure_optimizers reads only these of the trainer
        model.trainer = SimpleNamespace(max_steps=steps, precision_plugin=None, gradient_clip_val=1.0)
        config = model.configure_optimizers()
        model.trainer = None
        self.model, self.optimizer = model.train(), config["optimizer"]
        self.scheduler = config["lr_scheduler"]["scheduler"]
        # Lightning clips over the optimizer's parameters in group order; the order changes the norm's last bits.
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, batch: Batch) -> None:
        loss = self.model.training_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)  # Lightning zeroes after the forward, before backward
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        if torch.isfinite(loss) and torch.isfinite(norm):  # a bad step changes nothing (one host sync)
            self.optimizer.step()
        self.scheduler.step()


class Lockstep(Callback):
    """Runs plain step i at the start of Lightning's step i, recording when it started and ended, and times
    every other callback's step hooks in the steps after the warm-up."""

    def __init__(self, plain: PlainLoop, batches: list[Batch], warmup: int) -> None:
        self.plain, self.batches, self.warmup = plain, batches, warmup
        self.stamps: list[tuple[float, float]] = []
        self.callback_seconds: dict[str, float] = defaultdict(float)
        self.moments: dict[str, list[float]] = defaultdict(list)  # fit start, first and last step, validations

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":  # the validation before training sets up too: wrap the hooks once
            return
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if callback is not self:
                for hook in STEP_HOOKS:
                    setattr(callback, hook, self.timed(type(callback).__name__, getattr(callback, hook)))

    def timed(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = hook(*args, **kwargs)
            if self.warmup < len(self.stamps) < len(self.batches):  # the timed steps, without the final save
                self.callback_seconds[name] += time.perf_counter() - start
            return result

        return run

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Batch, batch_idx: int) -> None:
        start = time.perf_counter()
        self.plain.step(self.batches[batch_idx])
        self.stamps.append((start, time.perf_counter()))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.moments["validation_start"].append(time.perf_counter())

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.moments["validation_end"].append(time.perf_counter())

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.moments["last_step_end"] = [time.perf_counter()]


class Run(SimpleNamespace):
    lightning: list[float]
    plain: list[float]
    equal: tuple[bool, float]
    callbacks: dict[str, float]  # seconds per timed step
    before: float  # seconds from fit's start to the first step
    validation: float  # seconds of the validation before training
    after: float  # seconds from the last step's end to fit's return


def run_both(cfg: DictConfig, initial: PretrainingObjective, batches: list[Batch], warmup: int) -> Run:
    """Train copies of `initial` in lockstep: the template as `pretrain` builds it, and the plain loop."""
    lightning, plain = copy.deepcopy(initial), PlainLoop(copy.deepcopy(initial), len(batches))
    lockstep = Lockstep(plain, batches, warmup)
    datamodule = instantiate(cfg.data, tokenizer=instantiate(cfg.tokenizer))
    lineage = run_lineage(cfg, datamodule, None)
    trainer = build_trainer(cfg, datamodule, callbacks=[lineage, DataCounts(), lockstep])
    start = time.perf_counter()
    fit(trainer, lightning, datamodule, validate_first=True, resume=None)
    end = time.perf_counter()
    assert trainer.global_step == len(batches), f"Lightning ran {trainer.global_step} of {len(batches)} steps"
    assert not weights_equal(initial, plain.model)[0], "training left the weights unchanged"
    stamps, moments = lockstep.stamps[warmup:], lockstep.moments
    timed_steps = len(stamps) - 1
    return Run(
        lightning=[following[0] - current[1] for current, following in itertools.pairwise(stamps)],
        plain=[end - start for start, end in stamps[:-1]],
        equal=weights_equal(lightning, plain.model),
        callbacks={name: seconds / timed_steps for name, seconds in lockstep.callback_seconds.items()},
        before=lockstep.stamps[0][0] - start,
        validation=moments["validation_end"][0] - moments["validation_start"][0],
        after=end - moments["last_step_end"][0],
    )


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, float]:
    """Whether every parameter is bitwise equal, and the largest absolute difference."""
    pairs = [(x, y) for (m, x), (n, y) in zip(a.named_parameters(), b.named_parameters(), strict=True) if m == n]
    if len(pairs) != len(list(a.parameters())):
        return False, float("nan")
    return all(torch.equal(x, y) for x, y in pairs), max((x - y).abs().max().item() for x, y in pairs)


def loader_tokens_per_s(loader: DataLoader, batches: int, warmup: int = 20) -> float:
    iterator = iter(loader)
    for _ in range(warmup):  # worker start-up and the first shard's shuffle buffer
        next(iterator)
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        tokens += next(iterator)["tokens"][:, :-1].numel()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stdlib", help="shard directory with a manifest.json")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="lockstep runs (fresh models and Trainer each)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by other work)")
    parser.add_argument("--loader-batches", type=int, default=200, help="batches timed from the DataLoader")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the clm_tiny run (another shape, ...)")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps - 1:
        parser.error("--warmup must be below --steps - 1")

    warnings.filterwarnings("ignore", ".*(does not have many workers|val_dataloader|treespec).*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    runs: list[Run] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            cfg = run_config(args, out)
            prepare_process(cfg)
            tokenizer = instantiate(cfg.tokenizer)
            initial = build_objective(cfg.model, instantiate(cfg.data, tokenizer=tokenizer).format)
            twin = instantiate(cfg.data, tokenizer=tokenizer)  # the same data, read ahead for the plain loop
            batches = list(itertools.islice(twin.train_dataloader(), args.steps))
            runs.append(run_both(cfg, initial, batches, args.warmup))
    tokens_per_step = batches[0]["tokens"][:, :-1].numel()
    print_report(args, runs, tokens_per_step)

    loader = instantiate(cfg.data, tokenizer=tokenizer, verify_checksums=False).train_dataloader()
    delivered = loader_tokens_per_s(loader, args.loader_batches)
    consumed = tokens_per_step / statistics.median(t for run in runs for t in run.lightning)
    print(
        f"loader delivers {delivered:,.0f} tokens/s (num_workers={loader.num_workers}), model consumes {consumed:,.0f}"
    )
    throughput = delivered / consumed
    print(f"loader / model throughput: {throughput:.1f}x (goal >= 10: {'met' if throughput >= 10 else 'NOT met'})")


def run_config(args: argparse.Namespace, out: str) -> DictConfig:
    """The default clm_tiny run of `--steps` steps, writing into `out`, validated before and after training."""
    overrides = [
        "experiment=clm_tiny",
        f"data.dir={args.data}",
        f"paths.output_dir={out}",
        f"paths.log_dir={out}",
        "logger=csv",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    if args.steps <= cfg.model.warmup_steps:
        raise SystemExit(f"--steps must exceed model.warmup_steps={cfg.model.warmup_steps} (the warmup must end)")
    return cfg


def print_report(args: argparse.Namespace, runs: list[Run], tokens_per_step: int) -> None:
    times = {name: [t for run in runs for t in getattr(run, name)] for name in ("lightning", "plain")}
    median = {name: statistics.median(run) for name, run in times.items()}
    print(f"threads={args.threads}, {args.repeats} lockstep runs of {args.steps} steps, steps {args.warmup}..", end="")
    print(f"{args.steps - 2} timed, {tokens_per_step} tokens per step")
    print(f"{'loop':<10}{'ms/step':>9}{'tokens/s':>10}   per-run median ms/step")
    for name in times:
        per_run = " ".join(f"{statistics.median(getattr(run, name)) * 1e3:.1f}" for run in runs)
        print(f"{name:<10}{median[name] * 1e3:>9.1f}{tokens_per_step / median[name]:>10,.0f}   {per_run}")
    ratios = [a / b for a, b in zip(times["lightning"], times["plain"], strict=True)]
    ratio, (low, _, high) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
    verdict = "met" if ratio <= 1.03 else "NOT met"
    print(
        f"template / plain step time: {ratio:.3f} (per-step quartiles {low:.3f}..{high:.3f}; goal <= 1.03: {verdict})"
    )
    means = {name: statistics.mean(run) for name, run in times.items()}
    print(
        f"template / plain mean step time: {means['lightning'] / means['plain']:.3f} "
        f"({means['lightning'] * 1e3:.1f} / {means['plain'] * 1e3:.1f} ms: the steps that write logs included)"
    )
    print("per step, in the template's callbacks (mean over the timed steps of all runs; share of the mean step):")
    names = sorted(
        {name for run in runs for name in run.callbacks}, key=lambda n: -sum(r.callbacks.get(n, 0) for r in runs)
    )
    for name in names:
        seconds = statistics.mean(run.callbacks.get(name, 0.0) for run in runs)
        print(f"  {name:<22}{seconds * 1e3:>8.3f} ms {seconds / means['lightning']:>8.3%}")
    fixed = {
        "before the first step": "before",
        "  of which the first validation": "validation",
        "after the last step": "after",
    }
    for label, key in fixed.items():
        print(f"{label:<32}{statistics.median(getattr(run, key) for run in runs):>7.2f} s")
    equal = all(run.equal[0] for run in runs)
    suffix = "" if equal else f" (max abs diff {max(run.equal[1] for run in runs):.3g})"
    print(f"weights bitwise equal after {args.steps} steps: {equal}{suffix}")


if __name__ == "__main__":
    main()
