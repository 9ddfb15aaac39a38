"""How long each console command takes to start, as a ratio to `python -c "import torch"` on this machine.

    python scripts/bench/bench_startup.py [--repeats 5]

`--help` and `--cfg job` should load no torch (`pretraining.cli`): their ratio stays well below 1. The
commands that do work (here `pretrain-info` of a file that is not there, and a `pretrain` refused at its
config check) load torch and Lightning, so they show what a command with work costs before it starts.
The median of `--repeats` runs of each is printed (the first run of all warms the file cache).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
COMMANDS = [
    ["pretrain", "--help"],
    ["pretrain", "experiment=clm_tiny", "--cfg", "job"],
    ["pretrain-eval", "--help"],
    ["pretrain-data", "--help"],
    ["pretrain-data", "build", "--help"],
    ["pretrain-info", "--help"],
    ["pretrain-export", "--help"],
    ["pretrain-plot", "--help"],
    ["pretrain-sweep-report", "--help"],
    # with work to do: they load torch and Lightning
    ["pretrain-info", "no-such.ckpt"],
    ["pretrain", "experiment=clm_tiny", "trainer.max_steps=0"],
]


def seconds(command: list[str], repeats: int) -> float:
    """The median wall time of `repeats` runs of `command` (its exit status is not checked: a refusal
    is a start-up too)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch_import = [sys.executable, "-c", "import torch"]
    seconds(torch_import, 1)  # warm the file cache
    baseline = seconds(torch_import, args.repeats)
    print(f"python -c 'import torch': {baseline:.2f} s (the unit below)\n")
    print(f"{'command':<55} {'seconds':>8} {'ratio':>7}")
    for command in COMMANDS:
        took = seconds([str(BIN / command[0]), *command[1:]], args.repeats)
        print(f"{' '.join(command):<55} {took:>8.2f} {took / baseline:>7.2f}")


if __name__ == "__main__":
    main()
