"""Train a run with the real `pretrain` command, for the benchmarks that compare trained models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pretraining.checkpoint import newest_verified


def pretrain(log_dir: Path, run: str, steps: int, data: Path, *overrides: str) -> Path:
    """Train (or finish) run `run` with `pretrain`; its newest verified checkpoint."""
    command = [
        sys.executable,
        "-m",
        "pretraining",
        *overrides,
        f"trainer.max_steps={steps}",
        f"data.dir={data}",
        f"paths.log_dir={log_dir}",
        f"run_name={run}",
        "logger=csv",
    ]
    print(f"training {run}: {' '.join(command[3:])}", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    found = newest_verified(log_dir / "train" / "runs" / run / "checkpoints")
    assert found is not None, f"{run} saved no checkpoint"
    return found[0]
