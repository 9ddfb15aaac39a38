"""scripts/bench/bench_mixture.py runs at a tiny size: a row for one source, 2 and 8, and each mixture's realised
shares, which add up to one and stay near the weights."""

from __future__ import annotations

import re
import subprocess
import sys

from pretraining.config import PROJECT_ROOT

TINY = [
    "model.backbone.d_model=32",
    "model.backbone.n_layer=1",
    "model.backbone.n_head=2",
    "model.backbone.max_seq_len=64",
    "data.global_batch_size=8",
    "trainer.log_every_n_steps=2",
]


def test_the_mixture_benchmark_prints_each_variant_and_its_shares() -> None:
    script = PROJECT_ROOT / "scripts" / "bench" / "bench_mixture.py"
    command = [sys.executable, str(script), "--steps", "6", "--warmup", "2", "--repeats", "1"]
    command += ["--max-documents", "120", "--shard-kb", "16", "--", *TINY]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = finished.stdout.splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith("sources"))
    rows = [line.split() for line in lines[start + 1 : start + 4]]
    assert [row[0] for row in rows] == ["1", "2", "8"]
    assert rows[0][2] == "1.000"  # the ratio of the one source to itself
    assert all(len(row) == 9 and float(row[1]) > 0 and row[3].endswith("%") for row in rows)

    report = "\n".join(lines[start + 4 :])
    for sources, names in ((2, ["parts0-3", "parts4-7"]), (8, [f"part{i}" for i in range(8)])):
        header = re.search(rf"^  {sources} sources, 48 examples \(largest difference ([\d.]+)\):$", report, re.M)
        assert header, report
        cells = re.findall(r"(part\S+) ([\d.]+) \(([\d.]+)\)", report[header.end() :])[: len(names)]
        assert [name for name, _, _ in cells] == names
        assert abs(sum(float(share) for _, share, _ in cells) - 1) < 1e-3
        assert abs(sum(float(weight) for _, _, weight in cells) - 1) < 1e-3
        assert abs(max(abs(float(share) - float(weight)) for _, share, weight in cells) - float(header[1])) <= 2e-4
    assert re.search(r"largest data wait [\d.]+% of a step \(goal < 2%: (met|NOT met)\)$", lines[-1])
