"""Template overhead vs a plain PyTorch loop, and loader vs model throughput (CPU, one process).

1. The clm_tiny CausalLM trains N identical, pre-fetched batches (a) through a Lightning `Trainer` configured like
   configs/trainer/default.yaml and (b) through a plain loop doing what Lightning does per step: zero_grad, loss,
   backward, clip_grad_norm_(1.0) over the optimizer's params, optimizer.step, scheduler.step. Runs are interleaved
   (L P, P L, ...). Steps are timed start to start, so a step includes all of Lightning's per-step work (hooks,
   logging, the LR scheduler, fetching the next batch); the first `--warmup` steps are left out, and the step time of
   a loop is the median over all its timed steps of all runs (robust to other work on a shared machine; the per-run
   medians show the spread). Read `template / plain`: goal <= 1.03.
2. Both runs start from the same weights; after N steps every parameter must be bitwise equal (`torch.equal`).
3. The training DataLoader (default num_workers) must deliver tokens at >= 10x the rate the model consumes them.

    python scripts/bench_overhead.py --data data/stdlib [--steps 50 --repeats 2 --threads 1]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.objectives import PretrainingObjective

Batch = dict[str, torch.Tensor]


class StepClock(Callback):
    """Records perf_counter at the start of every training step."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Batch, batch_idx: int) -> None:
        self.stamps.append(time.perf_counter())


def step_times(stamps: list[float], warmup: int) -> list[float]:
    """Seconds of every step after the first `warmup`, start to start (the last step has no end stamp)."""
    return [end - start for start, end in zip(stamps[warmup:-1], stamps[warmup + 1 :], strict=True)]


def train_lightning(model: PretrainingObjective, loader: DataLoader, steps: int, warmup: int) -> list[float]:
    clock = StepClock()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=1,
        precision="32-true",
        logger=False,
        callbacks=[clock],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        use_distributed_sampler=False,
    )
    trainer.fit(model, train_dataloaders=loader)
    assert trainer.global_step == steps, f"Lightning ran {trainer.global_step} optimizer steps, not {steps}"
    return step_times(clock.stamps, warmup)


def train_plain(model: PretrainingObjective, loader: DataLoader, steps: int, warmup: int) -> list[float]:
    model.trainer = SimpleNamespace(max_steps=steps)  # configure_optimizers reads only trainer.max_steps
    config = model.configure_optimizers()
    model.trainer = None
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    params = [p for group in optimizer.param_groups for p in group["params"]]  # Lightning's clipping order
    model.train()
    stamps = []
    for batch in loader:
        stamps.append(time.perf_counter())
        loss = model.training_loss(batch)
        optimizer.zero_grad(set_to_none=True)  # Lightning zeroes after the forward, before backward
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
    return step_times(stamps, warmup)


def loader_tokens_per_s(loader: DataLoader, batches: int, warmup: int = 20) -> float:
    iterator = iter(loader)
    for _ in range(warmup):  # worker start-up and the first shard's shuffle buffer
        next(iterator)
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        tokens += next(iterator)["tokens"][:, :-1].numel()
    return tokens / (time.perf_counter() - start)


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> tuple[bool, float]:
    """Whether every parameter is bitwise equal, and the largest absolute difference."""
    pairs = [(x, y) for (m, x), (n, y) in zip(a.named_parameters(), b.named_parameters(), strict=True) if m == n]
    if len(pairs) != len(list(a.parameters())):
        return False, float("nan")
    return all(torch.equal(x, y) for x, y in pairs), max((x - y).abs().max().item() for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stdlib", help="shard directory with a manifest.json")
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each loop (order alternates)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both loops (1: robust to other work)")
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
            f"--steps must exceed model.warmup_steps={cfg.model.warmup_steps} (configure_optimizers checks it)"
        )
    seed_everything(cfg.seed, verbose=False)
    tokenizer = instantiate(cfg.tokenizer)
    initial = instantiate(cfg.model, backbone={"vocab_size": tokenizer.vocab_size})
    fixed = instantiate(cfg.data, dir=args.data, tokenizer=tokenizer, num_workers=0).train_dataloader()
    batches = list(itertools.islice(fixed, args.steps))
    tokens_per_step = batches[0]["tokens"][:, :-1].numel()

    runs: dict[str, Callable[[PretrainingObjective, DataLoader, int, int], list[float]]] = {
        "lightning": train_lightning,
        "plain": train_plain,
    }
    times: dict[str, list[list[float]]] = {name: [] for name in runs}
    all_equal, max_diff = True, 0.0
    for repeat in range(args.repeats):
        trained = {}
        for name in list(runs)[:: 1 if repeat % 2 == 0 else -1]:  # alternate the order against drift
            model = copy.deepcopy(initial)
            times[name].append(runs[name](model, DataLoader(batches, batch_size=None), args.steps, args.warmup))
            trained[name] = model
        equal, diff = weights_equal(trained["lightning"], trained["plain"])
        all_equal, max_diff = all_equal and equal, max(max_diff, diff)
        assert not weights_equal(initial, trained["plain"])[0], "training left the weights unchanged"

    loader = instantiate(cfg.data, dir=args.data, tokenizer=tokenizer, verify_checksums=False).train_dataloader()
    delivered = loader_tokens_per_s(loader, args.loader_batches)

    median = {name: statistics.median(t for run in times[name] for t in run) for name in runs}
    print(f"threads={args.threads}, {args.steps} steps per run, steps {args.warmup}..{args.steps - 2} timed, ", end="")
    print(f"{args.repeats} interleaved runs per loop, {tokens_per_step} tokens per step")
    print(f"{'loop':<10}{'ms/step':>9}{'tokens/s':>10}   per-run median ms/step")
    for name in runs:
        per_run = " ".join(f"{statistics.median(run) * 1e3:.1f}" for run in times[name])
        print(f"{name:<10}{median[name] * 1e3:>9.1f}{tokens_per_step / median[name]:>10,.0f}   {per_run}")
    ratio = median["lightning"] / median["plain"]
    print(f"template / plain step time: {ratio:.3f} (goal <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
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
