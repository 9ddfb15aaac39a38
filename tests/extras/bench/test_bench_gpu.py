"""scripts/bench/bench_gpu.py runs: in smoke mode (tiny sizes on the CPU) it prints a row for every case."""

from __future__ import annotations

import re
import subprocess
import sys

from pretraining.config import PROJECT_ROOT


def test_the_gpu_benchmark_prints_every_row_in_smoke_mode() -> None:
    script = PROJECT_ROOT / "scripts" / "bench" / "bench_gpu.py"
    finished = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [re.split(r"\s{2,}", line.strip()) for line in finished.stdout.splitlines()[3:]]  # cells: 2+ spaces apart
    expected = [
        ("GPT-2 124M next-token", "32"),
        ("GPT-2 124M, documents masked", "32"),
        ("BERT-base masked-LM", "4"),
        ("BERT-base masked-LM", "16"),
    ]
    assert [(row[0], row[1]) for row in rows] == [*expected, ("BERT-base contrastive", "8+16")]
    assert all(len(row) == 8 and float(row[4]) > 0 for row in rows)  # row[4]: template / plain tokens per second
