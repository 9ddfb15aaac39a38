"""Training throughput on one GPU: the template (its LightningModule through a Lightning Trainer) against a
plain PyTorch loop over the same model, on synthetic token data (no shards needed).

Cases: GPT-2 small (configs/model/clm_gpt2.yaml, next token, 1024 context; again with model.document_masking
over documents of 256 tokens on average: FlexAttention's block-sparse kernel), BERT-base (configs/model/mlm_bert.yaml,
masked LM at 128 and 512 context) and a BERT-base-sized contrastive pair model (configs/model/contrastive.yaml,
64-token queries, 256-token passages). Both loops run bf16 autocast (the Trainer's bf16-mixed), per-block
torch.compile, fused AdamW and gradient clipping at 1.0, from the same initial weights, in this process.

Timing: `--warmup` steps first (compilation, autotuning, allocator warm-up: never timed), then `--steps` steps
between two `torch.cuda.synchronize()`; the template's clock is read in on_train_batch_end, so Lightning's own
per-step work and its batch fetching count. Columns: tokens/s of each (both towers' tokens for the pair model,
padding included), template / plain, the template's MFU (model FLOPs from `Transformer.flops_per_token` over the
device's dense bf16 peak), its peak allocated memory, and the share of the timed wall time spent fetching batches
from the loader (host side; the batches are pre-built, so this is the loop's own cost).

    python scripts/bench/bench_gpu.py [--steps 30 --warmup 10] [--case GPT-2]
    python scripts/bench/bench_gpu.py --smoke    # tiny sizes on the CPU in seconds, float32, no compile
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer

from pretraining.callbacks.throughput import peak_flops
from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.objectives.base import PretrainingObjective

Batch = dict[str, torch.Tensor]
FIRST_ORDINARY_ID = 8  # above the special tokens, so that masking can select every position


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a configs/model/ option
    vocab_size: int
    batch_size: int
    block_size: int | None = None  # packed blocks; or pairs:
    pair_lengths: tuple[int, int] | None = None
    overrides: list[str] = field(default_factory=list)
    document_tokens: int | None = None  # packed documents of this mean length (for model.document_masking)

    @property
    def context(self) -> str:
        return str(self.block_size) if self.pair_lengths is None else "+".join(map(str, self.pair_lengths))

    def batch(self) -> Batch:
        def tokens(length: int) -> torch.Tensor:
            return torch.randint(FIRST_ORDINARY_ID, self.vocab_size, (self.batch_size, length))

        ids = {"sample_id": torch.randint(0, 2**62, (self.batch_size,))}
        if self.pair_lengths is None:
            length = self.block_size + 1  # type: ignore[operator]
            return {"tokens": tokens(length), "doc_ids": self.documents(length), **ids}
        query, passage = self.pair_lengths
        return {"query": tokens(query), "passage": tokens(passage), **ids}

    def documents(self, length: int) -> torch.Tensor:
        """Each token's document: one a row, or documents of random lengths averaging `document_tokens`."""
        if self.document_tokens is None:
            return torch.zeros(self.batch_size, length, dtype=torch.int64)
        starts = torch.rand(self.batch_size, length) < 1 / self.document_tokens
        starts[:, 0] = False
        return starts.cumsum(1)


BERT_BASE = ["backbone.d_model=768", "backbone.n_layer=12", "backbone.n_head=12", "backbone.max_seq_len=512"]
GPU_CASES = [
    Case("GPT-2 124M next-token", "clm_gpt2", 50257, 16, block_size=1024),
    Case("GPT-2 124M, documents masked", "clm_gpt2", 50257, 16, 1024, None, ["document_masking=true"], 256),
    Case("BERT-base masked-LM", "mlm_bert", 30522, 256, block_size=128),
    Case("BERT-base masked-LM", "mlm_bert", 30522, 64, block_size=512),
    Case("BERT-base contrastive", "contrastive", 30522, 128, pair_lengths=(64, 256), overrides=BERT_BASE),
]
TINY = ["backbone.d_model=32", "backbone.n_layer=1", "backbone.n_head=2", "backbone.max_seq_len=64"]
SMOKE_CASES = [
    Case(
        case.name,
        case.model,
        300,
        4,
        case.block_size and case.block_size // 32,
        lengths,
        [*case.overrides, *TINY],
        case.document_tokens and 8,
    )
    for case in GPU_CASES
    for lengths in [case.pair_lengths and (8, 16)]
]


class TimedBatches:
    """The same pre-built batches, cycled, recording when each was fetched and how long that took."""

    def __init__(self, batches: list[Batch], count: int) -> None:
        self.batches, self.count = batches, count
        self.fetches: list[tuple[float, float]] = []  # (end time, seconds)

    def __iter__(self) -> Iterator[Batch]:
        for index in range(self.count):
            start = time.perf_counter()
            batch = self.batches[index % len(self.batches)]
            end = time.perf_counter()
            self.fetches.append((end, end - start))
            yield batch

    def wait_between(self, start: float, end: float) -> float:
        return sum(seconds for at, seconds in self.fetches if start < at <= end)


@dataclass
class Run:
    seconds: float
    wait: float
    peak_memory: float | None


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepClock(Callback):
    """Reads the clock (after a device sync) at the end of step `warmup` and of the last step."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total
        self.start = self.end = 0.0

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: object) -> None:
        if trainer.global_step == self.warmup:
            self.start = sync(module.device)
        elif trainer.global_step == self.total:
            self.end = sync(module.device)


def run_template(
    model: PretrainingObjective, loader: TimedBatches, warmup: int, device: torch.device, precision: str
) -> Run:
    clock = StepClock(warmup, loader.count)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        trainer_config = compose("train", overrides=["trainer=gpu"]).trainer
    with tempfile.TemporaryDirectory() as root:
        trainer = instantiate(
            trainer_config,
            default_root_dir=root,
            accelerator=device.type,
            devices=1,
            precision=precision,
            max_steps=loader.count,
            limit_val_batches=0,
            callbacks=[clock],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=loader)
    assert trainer.global_step == loader.count, f"Lightning ran {trainer.global_step} of {loader.count} steps"
    return Run(clock.end - clock.start, loader.wait_between(clock.start, clock.end), peak_memory(device))


def run_plain(
    model: PretrainingObjective, loader: TimedBatches, warmup: int, device: torch.device, precision: str
) -> Run:
    """What the Trainer does per step, in plain PyTorch: autocast forward, backward, clip, step, schedule."""
    model.configure_model()  # compiles the blocks, as Lightning's call does for the template
    model.to(device).train()
    # configure_optimizers reads only these of the trainer
    model.trainer = SimpleNamespace(max_steps=loader.count, precision_plugin=None, gradient_clip_val=1.0)
    config = model.configure_optimizers()
    model.trainer = None
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    start = end = 0.0
    for step, batch in enumerate(loader, start=1):
        batch = {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
        with autocast:
            loss = model.training_loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        if step == warmup:
            start = sync(device)
    end = sync(device)
    return Run(end - start, loader.wait_between(start, end), peak_memory(device))


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def fresh_device(device: torch.device) -> None:
    """Free the previous run's memory and compiled graphs; zero the peak-memory counter."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> list[str]:
    compile_ = "true" if not args.smoke else "false"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={case.model}", f"model.compile={compile_}"])
    cfg.model.merge_with_dotlist(case.overrides)
    torch.manual_seed(0)
    initial = instantiate(cfg.model, backbone={"vocab_size": case.vocab_size})
    batches = [case.batch() for _ in range(4)]
    total = args.warmup + args.steps
    work = initial.batch_work(batches[0])
    precision = "32-true" if args.smoke else "bf16-mixed"

    runs = {}
    for name, run in [("template", run_template), ("plain", run_plain)]:
        fresh_device(device)
        runs[name] = run(copy.deepcopy(initial), TimedBatches(batches, total), args.warmup, device, precision)
    tokens_per_s = {name: work.tokens * args.steps / run.seconds for name, run in runs.items()}
    template = runs["template"]
    peak = peak_flops(device, torch.bfloat16 if precision == "bf16-mixed" else torch.float32)
    mfu = f"{work.flops * args.steps / template.seconds / peak:.1%}" if peak else "-"
    memory = f"{template.peak_memory:.1f} GiB" if template.peak_memory is not None else "-"
    return [
        case.name,
        case.context,
        f"{tokens_per_s['template']:,.0f}",
        f"{tokens_per_s['plain']:,.0f}",
        f"{tokens_per_s['template'] / tokens_per_s['plain']:.3f}",
        mfu,
        memory,
        f"{template.wait / template.seconds:.2%}",
    ]


def print_table(rows: list[list[str]]) -> None:
    header = ["model", "context", "tokens/s template", "tokens/s plain", "ratio", "MFU", "peak mem", "data wait"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        cells = zip(row, widths, strict=True)
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(cells)))  # names left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script in seconds")
    parser.add_argument("--case", default="", help="only the cases whose name contains this (GPT-2, BERT, ...)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke to check the script on the CPU")

    warnings.filterwarnings("ignore", ".*(does not have many workers|val_dataloader|treespec|LeafSpec).*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_float32_matmul_precision("high")
    device = torch.device("cpu" if args.smoke else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    mode = "float32, eager" if args.smoke else "bf16-mixed, compiled blocks, fused AdamW"
    print(f"{name}: {mode}; {args.warmup} warm-up + {args.steps} timed steps per run")
    cases = [case for case in (SMOKE_CASES if args.smoke else GPU_CASES) if args.case in case.name]
    if not cases:
        parser.error(f"no case's name contains {args.case!r}: {', '.join(case.name for case in GPU_CASES)}")
    print_table([bench_case(case, args, device) for case in cases])


if __name__ == "__main__":
    main()
