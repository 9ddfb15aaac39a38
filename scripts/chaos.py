"""Kill a training run with SIGKILL at random moments, restart it each time, and check that it
ends exactly as a run that was never interrupted: the same samples and bitwise the same loss at
every batch of every rank, and bitwise the same final weights.

The kills come from outside, at random times after a random batch (a step, a validation or a
checkpoint save may be under way), to the whole process group, as a machine failure would.
Restarting is running the same command again: the run finds its newest verified checkpoint.

    python scripts/chaos.py --data data/stdlib [--kills 3 --steps 60 --seed 0] [-- hydra overrides]
    python scripts/chaos.py --experiment distill_tiny -- model.teacher=<checkpoint or registry alias>
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pretraining.callbacks.batch_log import batch_log_differences, read_batch_log
from pretraining.checkpoint import saved_checkpoints

# A small model, dropout on (the per-batch reseeding matters), a checkpoint every 5 steps, 2 workers.
RUN = [
    "logger=csv",
    "model.backbone.d_model=64",
    "model.backbone.n_layer=2",
    "model.backbone.max_seq_len=128",
    "model.backbone.dropout=0.1",
    "model.warmup_steps=5",
    "data.global_batch_size=8",
    "data.num_workers=2",
    "data.val_size=16",
    "trainer.val_check_interval=20",
    "callbacks=[default,batch_log]",
    "callbacks.checkpoint.every_n_steps=5",
    "callbacks.text_sample.max_new_tokens=16",
]


def start(log_dir: Path, run: str, overrides: list[str]) -> subprocess.Popen:
    """Start a run in its own process group; its output goes to <log_dir>/<run>.out (a file: a pipe
    nobody reads while the script polls could fill up and stall the run)."""
    command = [sys.executable, "-m", "pretraining", *overrides, f"paths.log_dir={log_dir}", f"run_name={run}"]
    with (log_dir / f"{run}.out").open("a") as out:
        return subprocess.Popen(command, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, log_dir: Path, run: str) -> None:
    if process.wait(timeout=600) != 0:
        raise SystemExit(f"training failed ({process.returncode}):\n{(log_dir / f'{run}.out').read_text()[-3000:]}")


def last_batch(log: Path) -> int:
    lines = log.read_text().splitlines() if log.is_file() else []
    return json.loads(lines[-1])["batch"] if lines else 0


def kill_after_batch(process: subprocess.Popen, log: Path, batch: int, rng: random.Random) -> int | None:
    """SIGKILL the run's process group a random moment after it logs `batch`; the last batch it
    logged, or None if it finished first."""
    while process.poll() is None:
        if last_batch(log) >= batch:
            time.sleep(rng.uniform(0.0, 0.2))  # anywhere in the next step(s), a save included
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return last_batch(log)
        time.sleep(0.005)
    return None


def newest_step(checkpoints: Path) -> int:
    found = saved_checkpoints(checkpoints)
    return found[0][0] if found else 0


def final_weights(checkpoints: Path) -> dict[str, torch.Tensor]:
    (_, newest), *_ = saved_checkpoints(checkpoints)
    return torch.load(newest, weights_only=True)["state_dict"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stdlib", help="text shard directory")
    parser.add_argument("--experiment", default="clm_tiny", help="a next-token preset (clm_tiny, distill_tiny)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    parser.add_argument("--out", type=Path, default=None, help="where the two runs go (default: a temporary dir)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for both runs")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    log_dir = args.out or Path(tempfile.mkdtemp(prefix="chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"experiment={args.experiment}",
        *RUN,
        f"data.dir={Path(args.data).resolve()}",
        f"trainer.max_steps={args.steps}",
        *args.overrides,
    ]

    print(f"runs in {log_dir}\nreference: {args.steps} steps, uninterrupted")
    finish(start(log_dir, "reference", overrides), log_dir, "reference")
    chaos = log_dir / "train" / "runs" / "chaos"
    targets = sorted(rng.sample(range(3, args.steps - 2), args.kills))
    print(f"chaos: SIGKILL after batches {targets} (plus a random delay), restarting after each")
    for target in targets:
        resumes_from = newest_step(chaos / "checkpoints")
        reached = kill_after_batch(start(log_dir, "chaos", overrides), chaos / "batches" / "rank0.jsonl", target, rng)
        if reached is None:
            print(f"  the run finished before batch {target}")
            continue
        print(f"  started from step {resumes_from:3d}, killed after batch {reached}")
    finish(start(log_dir, "chaos", overrides), log_dir, "chaos")

    differences = batch_log_differences(log_dir / "train/runs/reference/batches", chaos / "batches")
    expected, actual = final_weights(log_dir / "train/runs/reference/checkpoints"), final_weights(chaos / "checkpoints")
    weights_equal = expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)
    batches = len(read_batch_log(chaos / "batches" / "rank0.jsonl"))
    lines = len((chaos / "batches" / "rank0.jsonl").read_text().splitlines())
    print(f"batches compared: {batches} (lines logged, replays included: {lines})")
    print(f"batches with other samples or losses: {len(differences)}")
    for difference in differences[:10]:
        print(f"  {difference}")
    print(f"final weights bitwise equal: {weights_equal}")
    if differences or not weights_equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
