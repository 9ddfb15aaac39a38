"""scripts/bench/bench_transfer.py runs at a tiny size: a loss for every rate of the grid at every size, under both
rules along both axes, the report of each sweep, and its files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretraining.config import PROJECT_ROOT


def test_the_transfer_benchmark_reports_each_sweep_and_writes_its_curves(tmp_path: Path) -> None:
    script = PROJECT_ROOT / "scripts" / "bench" / "bench_transfer.py"
    command = [sys.executable, str(script), "--widths", "32", "64", "--depths", "1", "2", "--depth-width", "32"]
    command += ["--steps", "3", "--batch", "2", "--optimizers", "adamw", "--out", str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    reports = re.findall(
        r"^(adamw, \w+, \w+): best rate 32x1: [\d.e-]+ \([\d.]+\), 64x1: .* grid steps from", finished.stdout, re.M
    )
    assert sorted(set(reports)) == ["adamw, mup, width", "adamw, standard, width"], finished.stdout
    depth = re.findall(r"^(adamw, \w+, depth): best rate 32x1: .*, 32x2: ", finished.stdout, re.M)
    assert sorted(set(depth)) == ["adamw, completep, depth", "adamw, standard, depth"], finished.stdout
    curves = json.loads((tmp_path / "transfer.json").read_text())
    assert set(curves) == {
        f"adamw, {name}" for name in ("standard, width", "mup, width", "standard, depth", "completep, depth")
    }
    assert all(len(losses) == 7 for sizes in curves.values() for losses in sizes.values())  # the grid: 7 rates


def test_the_transfer_benchmark_runs_only_the_sweeps_and_rates_asked_for(tmp_path: Path) -> None:
    script = PROJECT_ROOT / "scripts" / "bench" / "bench_transfer.py"
    command = [sys.executable, str(script), "--widths", "32", "64", "--axes", "width", "--rules", "switch"]
    command += ["--grid", "2", "4", "--steps", "3", "--batch", "2", "--optimizers", "adamw", "--out", str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    curves = json.loads((tmp_path / "transfer.json").read_text())
    assert list(curves) == ["adamw, mup, width"]
    rates = [sorted(map(float, losses)) for losses in curves["adamw, mup, width"].values()]
    assert rates == [pytest.approx([0.016, 0.032, 0.064])] * 2  # base 4e-3 x 2^2 .. 2^4, at both widths
