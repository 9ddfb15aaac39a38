"""Template overhead vs a plain PyTorch loop, and loader vs model throughput (CPU, one process).

1. The clm_tiny CausalLM trains N identical, pre-fetched batches (a) through the template's Trainer (built from
   configs/trainer/default.yaml, with its LR monitor, throughput callback, data-wait-timing loader and CSV logger)
   and (b) through a plain loop doing what Lightning does per step: zero_grad, loss, backward,
   clip_grad_norm_(1.0) over the optimizer's params, optimizer.step, scheduler.step. The two run in lockstep, on
   separate copies of the model: at the start of Lightning's step i a callback runs plain step i (timed on its
   own), so both see the same machine state and the slow drift of a shared machine cancels out. Lightning's step i
   is everything from the end of plain step i to the start of plain step i+1 (hooks, logging, the LR scheduler,
   fetching the next batch included). The first `--warmup` steps are left out; the step times are medians over
   all timed steps of all runs, and `template / plain` is the median of the per-step ratios: goal <= 1.03.
2. Both models start from the same weights; after N steps every parameter must be bitwise equal (`torch.equal`).
3. The training DataLoader (default num_workers) must deliver tokens at >= 10x the rate the model consumes them.

    python scripts/bench_overhead.py --data data/stdlib [--steps 50 --repeats 2 --threads 1]
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
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from pretraining.callbacks import Throughput
from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.data.loader import WaitTimedLoader
from pretraining.objectives import PretrainingObjective

Batch = dict[str, torch.Tensor]


class PlainLoop:
    """One training step the way Lightning does it, in plain PyTorch, with the objective's own optimizer setup."""

    def __init__(self, model: PretrainingObjective, steps: int) -> None:
        model.trainer = SimpleNamespace(max_steps=steps)  # configure_optimizers reads only trainer.max_steps
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
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()


class Lockstep(Callback):
    """Runs plain step i at the start of Lightning's step i and records when it started and ended."""

    def __init__(self, plain: PlainLoop, batches: list[Batch]) -> None:
        self.plain, self.batches = plain, batches
        self.stamps: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Batch, batch_idx: int) -> None:
        start = time.perf_counter()
        self.plain.step(self.batches[batch_idx])
        self.stamps.append((start, time.perf_counter()))


def train_both(
    initial: PretrainingObjective, batches: list[Batch], warmup: int, trainer_config: DictConfig, log_dir: str
) -> tuple[list[float], list[float], tuple[bool, float]]:
    """Train copies of `initial` in lockstep, Lightning with the template's trainer config, LR monitor, throughput
    callback and CSV logger: the timed Lightning and plain step seconds, and `weights_equal`."""
    lightning, plain = copy.deepcopy(initial), PlainLoop(copy.deepcopy(initial), len(batches))
    lockstep = Lockstep(plain, batches)
    trainer = instantiate(
        trainer_config,
        accelerator="cpu",
        max_steps=len(batches),
        max_epochs=1,
        callbacks=[lockstep, LearningRateMonitor(logging_interval="step"), Throughput()],
        logger=CSVLogger(log_dir),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(lightning, train_dataloaders=WaitTimedLoader(batches, batch_size=None))
    assert trainer.global_step == len(batches), f"Lightning ran {trainer.global_step} of {len(batches)} steps"
    assert not weights_equal(initial, plain.model)[0], "training left the weights unchanged"
    stamps = lockstep.stamps[warmup:]
    lightning_times = [following[0] - current[1] for current, following in itertools.pairwise(stamps)]
    return lightning_times, [end - start for start, end in stamps[:-1]], weights_equal(lightning, plain.model)


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
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps - 1:
        parser.error("--warmup must be below --steps - 1")

    warnings.filterwarnings("ignore", ".*(does not have many workers|val_dataloader|treespec).*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=clm_tiny"])
    if args.steps <= cfg.model.warmup_steps:
        parser.error(
            f"--steps must exceed model.warmup_steps={cfg.model.warmup_steps} (the warmup must end within the run)"
        )
    seed_everything(cfg.seed, verbose=False)
    trainer_config = cfg.trainer.copy()
    trainer_config.default_root_dir = None  # paths.output_dir only resolves inside a Hydra run
    tokenizer = instantiate(cfg.tokenizer)
    initial = instantiate(cfg.model, backbone={"vocab_size": tokenizer.vocab_size})
    fixed = instantiate(cfg.data, dir=args.data, tokenizer=tokenizer, num_workers=0).train_dataloader()
    batches = list(itertools.islice(fixed, args.steps))
    tokens_per_step = batches[0]["tokens"][:, :-1].numel()

    times: dict[str, list[float]] = {"lightning": [], "plain": []}
    per_run: dict[str, list[float]] = {"lightning": [], "plain": []}
    all_equal, max_diff = True, 0.0
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as log_dir:
            lightning, plain, (equal, diff) = train_both(initial, batches, args.warmup, trainer_config, log_dir)
        for name, run in [("lightning", lightning), ("plain", plain)]:
            times[name] += run
            per_run[name].append(statistics.median(run))
        all_equal, max_diff = all_equal and equal, max(max_diff, diff)

    loader = instantiate(cfg.data, dir=args.data, tokenizer=tokenizer, verify_checksums=False).train_dataloader()
    delivered = loader_tokens_per_s(loader, args.loader_batches)

    median = {name: statistics.median(run) for name, run in times.items()}
    print(f"threads={args.threads}, {args.repeats} lockstep runs of {args.steps} steps, steps {args.warmup}..", end="")
    print(f"{args.steps - 2} timed, {tokens_per_step} tokens per step")
    print(f"{'loop':<10}{'ms/step':>9}{'tokens/s':>10}   per-run median ms/step")
    for name in times:
        runs = " ".join(f"{t * 1e3:.1f}" for t in per_run[name])
        print(f"{name:<10}{median[name] * 1e3:>9.1f}{tokens_per_step / median[name]:>10,.0f}   {runs}")
    ratios = [a / b for a, b in zip(times["lightning"], times["plain"], strict=True)]
    ratio, (low, _, high) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
    verdict = "met" if ratio <= 1.03 else "NOT met"
    print(
        f"template / plain step time: {ratio:.3f} (per-step quartiles {low:.3f}..{high:.3f}; goal <= 1.03: {verdict})"
    )
    suffix = "" if all_equal else f" (max abs diff {max_diff:.3g})"
    print(f"weights bitwise equal after {args.steps} steps: {all_equal}{suffix}")
    consumed = tokens_per_step / median["lightning"]
    print(
        f"loader delivers {delivered:,.0f} tokens/s (num_workers={loader.num_workers}), model consumes {consumed:,.0f}"
    )
    throughput = delivered / consumed
    print(f"loader / model throughput: {throughput:.1f}x (goal >= 10: {'met' if throughput >= 10 else 'NOT met'})")


if __name__ == "__main__":
    main()
