"""What a mixture of sources costs a training step: one source against a 2-source and an 8-source mixture of
the same data (`data.sources`), in one process (CPU).

The data: the standard library's source (what `make data` builds), its files split by a hash of their
source id into 8 parts, each built into shards of its own by the package's builder (`build_shards`, shards of
at most `--shard-kb`) in a temporary directory. `index_shards` (what `pretrain-data index` runs) then
writes a manifest over all 8 parts' shards, the one source, and one over each half, the 2 sources; the 8
sources are the parts themselves. So every variant reads the same shard files, and each source's weight is
its share of the training text: the mixtures draw the data in the proportions the one source holds it in.

Each run is the clm_tiny job as `pretrain` builds it (`pretraining.run.build_trainer`: the default
callbacks, the CSV logger, the DataModule and its loader with the default `data.num_workers`), fresh
weights, no validation; the variants take turns (1, 2, 8, 8, 2, 1, ...), so that the drift of a shared
machine falls on all of them alike. Per step (from one batch's start to the next's), the step time and the
seconds the training loop waited for its batch (the loader's `waited`, `WaitTimedLoader`). Printed for each
variant, over all its runs:

- the median step time and its ratio to the one source's, over the steps after `--warmup`;
- the data wait as a share of the step time over those steps, over the first `--warmup` steps (where
  every (source, sub-stream) fills its first shuffle buffer: a mixture opens a shard for each) and before
  the first step (the workers' start and the first batches); and the Throughput callback's
  `perf/data_wait`, the mean of the values it logged;
- the DataLoader workers' CPU time per step (Linux's /proc; on a CPU, time they may take from the step), and
  the memory the stream holds after `--steps` steps (read again in this process, `tracemalloc`): each
  (source, sub-stream) read holds a shuffle buffer of up to `data.shuffle_buffer` examples;
- the share of the examples each source gave (`DataPosition.drawn`) against its weight.

Goal (the issue that asked for mixtures): no measurable cost, the data wait below 2 % of a step.

    python scripts/bench/bench_mixture.py [--steps 50 --warmup 10 --repeats 2 --threads 1] [-- hydra overrides]
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import itertools
import logging
import os
import statistics
import tempfile
import time
import tracemalloc
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import DictConfig

from pretraining.callbacks.data_counts import DataCounts
from pretraining.config import CONFIG_DIR  # registers the config resolvers
from pretraining.data.corpus import Document, normalize, read_stdlib
from pretraining.data.index import index_shards
from pretraining.data.shards import BuildSettings, build_shards, split_of
from pretraining.objectives.base import build_objective
from pretraining.run import build_trainer, prepare_process, run_lineage

PARTS = 8
VALIDATION_FRACTION = 0.05  # as `make data` builds the default corpus
GOAL_WAIT = 0.02  # the data wait's share of a step


@dataclass
class Corpus:
    """The parts' shard directories, and each part's bytes of training text (UTF-8)."""

    parts: list[Path]
    text_bytes: list[int]
    documents: int
    shards: list[int]  # training shards of each part

    def variant(self, sources: int, root: Path) -> dict[str, tuple[Path, float]]:
        """`sources` sources over the parts (consecutive parts each): name -> (shard directory, weight)."""
        per = PARTS // sources
        if sources == PARTS:
            return {f"part{i}": (part, self.text_bytes[i] / sum(self.text_bytes)) for i, part in enumerate(self.parts)}
        out = {}
        for first in range(0, PARTS, per):
            name = "all" if sources == 1 else f"parts{first}-{first + per - 1}"
            out[name] = (root / name, sum(self.text_bytes[first : first + per]) / sum(self.text_bytes))
            index_shards(
                [str(self.parts[i] / "train-*.tar") for i in range(first, first + per)],
                root / name,
                validation=[str(shard) for i in range(first, first + per) for shard in self.validation(i)],
                show_progress=False,
            )
        return out

    def validation(self, part: int) -> list[Path]:
        return sorted(self.parts[part].glob("validation-*.tar"))


def part_of(document: Document) -> int:
    return hashlib.sha256(document.source_id.encode()).digest()[0] % PARTS


def training(document: Document) -> bool:
    return split_of(document.source_id, VALIDATION_FRACTION) == "train"


def build_parts(root: Path, shard_kb: int, max_documents: int | None) -> Corpus:
    """The standard library's files in `PARTS` parts (by a hash of each file's source id), each built into
    shards of its own; at most `max_documents` files (the first, in path order)."""
    documents: list[list[Document]] = [[] for _ in range(PARTS)]
    for document in itertools.islice(read_stdlib(), max_documents):
        documents[part_of(document)].append(document)
    settings = BuildSettings(validation_fraction=VALIDATION_FRACTION, max_shard_bytes=shard_kb * 1024)
    parts, text_bytes, shards = [], [], []
    for number, part in enumerate(documents):
        out = root / f"part{number}"
        manifest = build_shards(part, out, [f"stdlib part {number}"], settings, show_progress=False)
        parts.append(out)
        text_bytes.append(sum(len(normalize(d.texts["txt"]).encode()) for d in part if d.texts and training(d)))
        shards.append(len(manifest["splits"]["train"]["shards"]))
    return Corpus(parts, text_bytes, sum(map(len, documents)), shards)


class StepClock(Callback):
    """When each training batch starts, the seconds the loop had waited for batches by then, and what the run's
    DataLoader workers used."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.waited: list[float] = []
        self.earlier: set[Path] = set()
        self.worker_cpu: float | None = None

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.waited.append(trainer.train_dataloader.waited)  # type: ignore[union-attr]

    def on_fit_start(self, trainer: Trainer, module: LightningModule) -> None:
        self.earlier = children()  # an earlier run's workers, if still there

    def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
        self.worker_cpu = workers_cpu(children() - self.earlier)


def children() -> set[Path]:
    """The /proc directories of this process's child processes (none off Linux)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.add(stat.parent)
        except (OSError, IndexError, ValueError):
            continue  # gone, or not readable
    return found


def workers_cpu(workers: set[Path]) -> float | None:
    """The CPU seconds so far of the DataLoader `workers` (their /proc directories); None without any."""
    seconds = None
    for directory in workers:
        try:
            fields = (directory / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone
        seconds = (seconds or 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return seconds


def stream_memory(cfg: DictConfig, sources: dict[str, tuple[Path, float]], steps: int) -> float:
    """MB that the training stream holds after `steps` steps' batches, read in this process (Python's
    allocations, `tracemalloc`): the shuffle buffers, one per (source, sub-stream) read so far."""
    cfg = data_config(cfg, sources)
    cfg.data.num_workers = 0
    datamodule = instantiate(cfg.data, tokenizer=instantiate(cfg.tokenizer), verify_checksums=False)
    tracemalloc.start()
    batches = iter(datamodule.train_dataloader())
    for _ in range(steps * datamodule.plan.accumulation):
        next(batches)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return held / 1e6


@dataclass
class Runs:
    """A variant's measurements, over all its runs."""

    steps: list[float] = field(default_factory=list)  # seconds of each step after the warm-up
    waits: list[float] = field(default_factory=list)  # seconds waited in each of them
    warmup_steps: list[float] = field(default_factory=list)
    warmup_waits: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # seconds waited before the first step
    logged_wait: list[float] = field(default_factory=list)  # perf/data_wait as logged
    worker_cpu: list[float] = field(default_factory=list)  # CPU seconds of the DataLoader workers per step
    stream_memory: float = float("nan")  # MB the stream holds at the end (read apart, in this process)
    drawn: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    weights: dict[str, float] = field(default_factory=dict)


def run_once(cfg: DictConfig, sources: dict[str, tuple[Path, float]], out: Path, warmup: int, runs: Runs) -> None:
    """Train the clm_tiny job on `sources` for the configured steps, adding its measurements to `runs`."""
    prepare_process(cfg)
    cfg = data_config(cfg, sources)
    tokenizer = instantiate(cfg.tokenizer)
    datamodule = instantiate(cfg.data, tokenizer=tokenizer)
    model = build_objective(cfg.model, datamodule.format)
    clock = StepClock()
    trainer = build_trainer(cfg, datamodule, callbacks=[run_lineage(cfg, datamodule, None), DataCounts(), clock])
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == cfg.trainer.max_steps, f"ran {trainer.global_step} of {cfg.trainer.max_steps} steps"
    steps = [b - a for a, b in itertools.pairwise(clock.starts)]
    waits = [b - a for a, b in itertools.pairwise(clock.waited)]
    runs.first.append(clock.waited[0])
    if clock.worker_cpu is not None:
        runs.worker_cpu.append(clock.worker_cpu / cfg.trainer.max_steps)
    runs.warmup_steps += steps[:warmup]
    runs.warmup_waits += waits[:warmup]
    runs.steps += steps[warmup:]
    runs.waits += waits[warmup:]
    metrics = out / "csv" / "metrics.csv"  # none where no step was logged (trainer.log_every_n_steps)
    with metrics.open() if metrics.is_file() else open(os.devnull) as file:
        runs.logged_wait += [float(row["perf/data_wait"]) for row in csv.DictReader(file) if row.get("perf/data_wait")]
    for source, drawn in zip(datamodule.sources, datamodule.position.drawn, strict=True):
        runs.drawn[source.name] += drawn
    runs.weights = {name: weight for name, (_, weight) in sources.items()}


def data_config(cfg: DictConfig, sources: dict[str, tuple[Path, float]]) -> DictConfig:
    """`cfg` training on `sources`: one as `data.dir`, several as `data.sources`."""
    cfg = copy.deepcopy(cfg)
    if len(sources) == 1:
        ((directory, _),) = sources.values()
        cfg.data.dir = str(directory)
    else:
        cfg.data.dir = None
        cfg.data.sources = {
            name: {"dir": str(directory), "weight": weight} for name, (directory, weight) in sources.items()
        }
    return cfg


def run_config(args: argparse.Namespace, out: Path) -> DictConfig:
    """The clm_tiny run of `--steps` steps writing into `out`, without validation and checkpoints on the way."""
    overrides = [
        "experiment=clm_tiny",
        f"paths.output_dir={out}",
        f"paths.log_dir={out}",
        "logger=csv",
        f"trainer.max_steps={args.steps}",
        "+trainer.limit_val_batches=0",
        f"callbacks.checkpoint.every_n_steps={args.steps + 1}",
        "callbacks.text_sample.max_new_tokens=1",
        *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps timed apart (shuffle buffers filling)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, in turns")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by other work)")
    parser.add_argument("--shard-kb", type=int, default=256, help="the parts' shard size bound (KiB)")
    parser.add_argument("--max-documents", type=int, default=None, help="the first N files of the library only")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the clm_tiny run (another shape, ...)")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps - 2:
        parser.error("--warmup must be below --steps - 2")

    warnings.filterwarnings("ignore", ".*(does not have many workers|val_dataloader|treespec|sub-streams).*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as directory:
        root = Path(directory)
        started = time.perf_counter()
        corpus = build_parts(root, args.shard_kb, args.max_documents)
        variants = {count: corpus.variant(count, root) for count in (1, 2, PARTS)}
        built = time.perf_counter() - started
        results = {count: Runs() for count in variants}
        turns = [(repeat, count) for repeat in range(args.repeats) for count in list(variants)[:: 1 - 2 * (repeat % 2)]]
        for repeat, count in turns:  # 1, 2, 8, 8, 2, 1, ...: a steady drift of the machine's speed falls evenly
            out = root / "runs" / f"{count}-{repeat}"
            out.mkdir(parents=True)
            run_once(run_config(args, out), variants[count], out, args.warmup, results[count])
        cfg = run_config(args, root)
        for count, runs in results.items():
            runs.stream_memory = stream_memory(cfg, variants[count], args.steps)
        tokens_per_step = cfg.data.global_batch_size * cfg.model.backbone.max_seq_len
    print_report(args, corpus, built, results, tokens_per_step, cfg.data.num_workers)


def share(waits: list[float], steps: list[float]) -> float:
    return sum(waits) / sum(steps) if steps else float("nan")


def print_report(
    args: argparse.Namespace, corpus: Corpus, built: float, results: dict[int, Runs], tokens: int, workers: int
) -> None:
    megabytes = sum(corpus.text_bytes) / 1e6
    print(
        f"the standard library's source: {corpus.documents:,} files, {megabytes:.1f} MB of training text, "
        f"in {PARTS} parts of {min(corpus.shards)} to {max(corpus.shards)} training shards "
        f"(<= {args.shard_kb} KiB; built and indexed in {built:.0f} s)"
    )
    print(
        f"threads={args.threads}, num_workers={workers}, {args.repeats} runs of {args.steps} steps per variant in "
        f"turns, {tokens:,} tokens per step; steps {args.warmup + 1}..{args.steps - 1} timed, 1..{args.warmup} "
        "the warm-up"
    )
    base = statistics.median(results[1].steps)
    header = f"{'sources':<8}{'ms/step':>9}{'/ one':>8}{'data wait':>11}{'warm-up':>9}{'perf/data_wait':>16}"
    print(f"{header}{'before step 1':>15}{'worker CPU ms/step':>20}{'stream MB':>11}")
    for count, runs in results.items():
        median = statistics.median(runs.steps)
        logged = statistics.mean(runs.logged_wait) if runs.logged_wait else float("nan")
        row = (
            f"{count:<8}{median * 1e3:>9.1f}{median / base:>8.3f}{share(runs.waits, runs.steps):>11.2%}"
            f"{share(runs.warmup_waits, runs.warmup_steps):>9.2%}{logged:>16.2%}"
        )
        cpu = f"{statistics.mean(runs.worker_cpu) * 1e3:>20.1f}" if runs.worker_cpu else f"{'n/a':>20}"
        print(f"{row}{statistics.median(runs.first):>14.2f}s{cpu}{runs.stream_memory:>11.1f}")
    print("realised shares (examples drawn / all examples, against the weight):")
    for count, runs in results.items():
        if count == 1:
            continue
        total = sum(runs.drawn.values())
        shares = {name: drawn / total for name, drawn in runs.drawn.items()}
        worst = max(abs(shares[name] - runs.weights[name]) for name in runs.weights)
        print(f"  {count} sources, {total:,} examples (largest difference {worst:.4f}):")
        cells = [f"{name} {shares[name]:.4f} ({runs.weights[name]:.4f})" for name in runs.weights]
        for first in range(0, len(cells), 4):
            print(f"    {', '.join(cells[first : first + 4])}")
    ratios = [statistics.median(runs.steps) / base for runs in results.values()]
    worst_wait = max(share(runs.waits, runs.steps) for runs in results.values())
    verdict = "met" if worst_wait < GOAL_WAIT else "NOT met"
    print(
        f"largest step time ratio to one source {max(ratios):.3f}; largest data wait {worst_wait:.2%} of a step "
        f"(goal < {GOAL_WAIT:.0%}: {verdict})"
    )


if __name__ == "__main__":
    main()
