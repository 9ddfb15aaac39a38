"""What exact resume costs: start-up time of a resumed run, and checkpoint save time.

1. Resume start-up at 10 % and at 90 % of an epoch: a short run writes a checkpoint, its data
   position is moved to 10 % and to 90 % of the first epoch (every worker in the middle of a
   shard), and `pretrain` is started from each; the time from process start to the first trained
   batch is measured (`--repeats` times, median). The stream skips finished shards by arithmetic
   and re-reads only the current one, so the two should be about equal: the ratio 90 % / 10 % is
   printed (goal: about 1).
2. Checkpoint save time against model size: a backbone with its AdamW state saved by the template's
   `AtomicCheckpointIO` (temporary file, fsync, read-back SHA-256, rename, directory fsync, sidecar)
   against a plain `torch.save` of the same dict into the same directory, in the same process; and
   what a background save (`callbacks.checkpoint.background`) blocks the step for: the copy of the
   state to host memory and the hand-over to the writer thread, as a ratio to the synchronous atomic
   save (goal: at most 0.2).

    python scripts/bench/bench_resume.py --data data/stdlib [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pretraining.checkpoint import saved_checkpoints
from pretraining.checkpoint.background import BackgroundWriter, host_copy
from pretraining.data.manifest import Manifest
from pretraining.models.transformer import Transformer
from pretraining.plugins.checkpoint_io import AtomicCheckpointIO

RUN = [
    "experiment=clm_tiny",
    "logger=csv",
    "data.num_workers=2",
    "callbacks=[default,batch_log]",
    "callbacks.checkpoint.every_n_steps=5",
    "callbacks.text_sample.max_new_tokens=1",
    "validate_before_training=false",
    "trainer.val_check_interval=1000",
    "model.warmup_steps=2",
]


def pretrain(log_dir: Path, run: str, overrides: list[str]) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "pretraining",
        *RUN,
        *overrides,
        f"paths.log_dir={log_dir}",
        f"run_name={run}",
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def seconds_to_first_batch(log_dir: Path, run: str, overrides: list[str]) -> float:
    """From process start to the first batch line of `run` (the process is then stopped)."""
    log = log_dir / "train" / "runs" / run / "batches" / "rank0.jsonl"
    log.unlink(missing_ok=True)
    started = time.perf_counter()
    process = pretrain(log_dir, run, overrides)
    while not (log.is_file() and log.read_text().strip()):
        if process.poll() is not None:
            raise SystemExit(f"the resumed run exited with {process.returncode} before training")
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    process.kill()
    process.wait()
    return elapsed


def resume_startup(data: Path, repeats: int) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    overrides = [f"data.dir={data.resolve()}"]
    if pretrain(log_dir, "base", [*overrides, "trainer.max_steps=5"]).wait() != 0:
        raise SystemExit("the base run failed")
    (_, base), *_ = saved_checkpoints(log_dir / "train" / "runs" / "base" / "checkpoints")
    checkpoint = torch.load(base, weights_only=True)
    num_shards = len(Manifest.load(data).urls("train"))
    cursors = checkpoint["ShardDataModule"]["cursors"]  # [sub-stream, shard ordinal, examples taken]
    workers = len(cursors)
    print(f"1. resume start-up ({num_shards} shards, {workers} workers; process start to first trained batch)")
    times = {}
    for fraction in (0.1, 0.9):
        ordinal = round(fraction * num_shards / workers)  # each worker reads every `workers`-th shard
        checkpoint["ShardDataModule"]["cursors"] = [[sub, ordinal, 500] for sub, *_ in cursors]
        run = f"at{round(fraction * 100)}"
        AtomicCheckpointIO().save_checkpoint(checkpoint, log_dir / "train" / "runs" / run / "checkpoints" / base.name)
        times[fraction] = statistics.median(
            seconds_to_first_batch(log_dir, run, [*overrides, "trainer.max_steps=10"]) for _ in range(repeats)
        )
        print(f"   at {fraction:.0%} of the epoch (shard {ordinal} of each worker, block 500): {times[fraction]:.2f} s")
    print(f"   90% / 10%: {times[0.9] / times[0.1]:.3f}")
    shutil.rmtree(log_dir)


def save_times() -> None:
    print("2. checkpoint save time, model + AdamW state (template atomic+verified vs plain torch.save), and the")
    print("   time a background save blocks the step (host copy + hand-over; the write itself runs on)")
    header = f"{'parameters':>12} {'MB':>8} {'plain s':>9} {'atomic s':>9} {'ratio':>7} {'blocks s':>9} {'/atomic':>8}"
    print(f"   {header} {'written s':>10}")
    directory = Path(tempfile.mkdtemp(prefix="bench-save-", dir="logs"))
    for d_model, n_layer in ((128, 4), (384, 6), (768, 8)):
        model = Transformer(vocab_size=50257, max_seq_len=1024, d_model=d_model, n_layer=n_layer, n_head=4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
        optimizer.step()  # creates the moment estimates
        state = {"global_step": 1, "state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
        started = time.perf_counter()
        torch.save(state, directory / "plain.ckpt")
        plain = time.perf_counter() - started
        started = time.perf_counter()
        AtomicCheckpointIO().save_checkpoint(state, directory / "atomic.ckpt")
        atomic = time.perf_counter() - started
        blocks, written = background_save(state, directory / "background.ckpt")
        megabytes = (directory / "atomic.ckpt").stat().st_size / 1e6
        parameters = sum(p.numel() for p in model.parameters())
        row = f"{parameters:>12,} {megabytes:>8.0f} {plain:>9.2f} {atomic:>9.2f} {atomic / plain:>7.2f}"
        print(f"   {row} {blocks:>9.3f} {blocks / atomic:>8.3f} {written:>10.2f}")
    shutil.rmtree(directory)


def background_save(state: dict, path: Path) -> tuple[float, float]:
    """(seconds the step is blocked, seconds until the file and its sidecar are written) of a background
    save, as `StepCheckpoint` makes it."""
    writer, started = BackgroundWriter(), time.perf_counter()
    copy = host_copy(state)
    writer.submit(path, lambda: AtomicCheckpointIO().save_checkpoint(copy, path))
    blocks = time.perf_counter() - started
    writer.finished(wait=True)
    return blocks, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    resume_startup(args.data, args.repeats)
    save_times()


if __name__ == "__main__":
    main()
