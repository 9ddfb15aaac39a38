"""Learning curves: metrics.csv as Lightning's CSV logger writes it (sparse rows, steps replayed
after a resume) becomes a PNG per run, and an overlay for a directory of runs."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from pretraining.config import PROJECT_ROOT
from pretraining.extras.plots.cli import main
from pretraining.extras.plots.plots import draw_overlay, draw_run, panels, plot, plot_overlay
from pretraining.extras.plots.run_logs import Series, read_metrics, run_labels
from pretraining.train import train

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SRC = PROJECT_ROOT / "src"

# Lightning's columns are sorted; each row holds what one log call logged at its step.
COLUMNS = [
    "data/skipped_samples",
    "epoch",
    "lr-AdamW/pg1",
    "lr-AdamW/pg2",
    "perf/data_wait",
    "perf/samples_per_s",
    "perf/step_time",
    "perf/tokens_per_s",
    "step",
    "train/loss",
    "val/bpb",
    "val/loss",
]


def write_metrics(run_dir: Path, rows: list[dict[str, float]]) -> Path:
    """A metrics.csv like Lightning's: one header, and each row empty where its metric was not logged."""
    path = run_dir / "csv" / "metrics.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def training_rows(steps: range, loss: float, every: int = 10) -> list[dict[str, float]]:
    """The rows a run over `steps` writes: validation before training (on a first start), then at each
    logging step the learning rate (LearningRateMonitor), the loss (self.log) and throughput (its own
    log_metrics call), and validation at the end."""
    rows: list[dict[str, float]] = []
    if steps.start == 0:
        rows.append({"epoch": 0, "step": 0, "val/loss": loss + 1, "val/bpb": (loss + 1) / 2})
    for step in steps:
        if (step + 1) % every == 0:
            rows.append({"step": step, "lr-AdamW/pg1": 1e-3, "lr-AdamW/pg2": 1e-3})
            rows.append({"epoch": 0, "step": step, "train/loss": loss - step / 100, "data/skipped_samples": 0.0})
            rows.append({"step": step, "perf/tokens_per_s": 1000.0 + step, "perf/data_wait": 0.1})
    rows.append({"epoch": 0, "step": steps[-1], "val/loss": loss, "val/bpb": loss / 2})
    return rows


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()  # decodes it all: a truncated file fails here
        width, height = image.size
    assert 400 < width < 4000 and 300 < height < 4000


def make_sweep(sweep: Path, learning_rates: list[str]) -> list[Path]:
    """A multirun directory as Hydra writes it: one numbered job directory per setting."""
    jobs = []
    for number, lr in enumerate(learning_rates):
        job = sweep / str(number)
        write_metrics(job, training_rows(range(40), loss=5.0 + number))
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text(f"- experiment=clm_tiny\n- model.optimizer.lr={lr}\n")
        jobs.append(job)
    return jobs


def test_read_metrics_keeps_the_later_row_of_a_replayed_step_and_sparse_columns(tmp_path: Path) -> None:
    # Killed after step 29, resumed from the checkpoint of step 20: steps 29 and 39's rows come again.
    rows = training_rows(range(30), loss=4.0) + training_rows(range(20, 40), loss=3.0)
    path = write_metrics(tmp_path, rows)
    with path.open("a") as file:
        file.write("7,0,0.001")  # a line cut short by a kill mid-write: no step, skipped

    metrics = read_metrics(path)

    assert metrics["train/loss"] == Series(
        [9, 19, 29, 39], [4.0 - 9 / 100, 4.0 - 19 / 100, 3.0 - 29 / 100, 3.0 - 39 / 100]
    )
    assert metrics["val/loss"] == Series([0, 29, 39], [5.0, 4.0, 3.0])  # 0 and 29: only the first run validated there
    assert metrics["perf/tokens_per_s"].steps == [9, 19, 29, 39]
    assert "epoch" not in metrics and "step" not in metrics


def test_panels_group_metrics_by_prefix() -> None:
    names = [
        "epoch",
        "train/loss",
        "val/loss",
        "val/q2p_mrr",
        "val/accuracy",
        "train/logit_scale",
        "probe/accuracy",
        "perf/mfu",
        "perf/tokens_per_s",
        "perf/step_time",
        "perf/data_wait",
        "lr-AdamW/pg1",
        "lr-AdamW/pg2",
        "data/skipped_samples",
        "grad/norm",
    ]
    assert [(panel.title, panel.metrics) for panel in panels(names)] == [
        ("loss", ["train/loss", "val/loss"]),
        ("val/accuracy", ["val/accuracy"]),
        ("val/q2p_mrr", ["val/q2p_mrr"]),
        ("train/logit_scale", ["train/logit_scale"]),
        ("probe/accuracy", ["probe/accuracy"]),
        ("perf/tokens_per_s", ["perf/tokens_per_s"]),
        ("perf/data_wait", ["perf/data_wait"]),
        ("perf/mfu", ["perf/mfu"]),
        ("learning rate", ["lr-AdamW/pg1", "lr-AdamW/pg2"]),
        ("grad/norm", ["grad/norm"]),
    ]


def test_constant_metrics_are_named_in_the_title_instead_of_drawn(tmp_path: Path) -> None:
    metrics = read_metrics(write_metrics(tmp_path, training_rows(range(30), 4.0)))  # the LR held at 1e-3
    figure = draw_run(metrics, "run")
    assert "learning rate" not in [ax.get_title() for ax in figure.axes]
    assert {"loss", "val/bpb", "perf/tokens_per_s"} <= {ax.get_title() for ax in figure.axes}
    flat_line = "constant, not drawn: lr-AdamW/pg1 = 0.001, lr-AdamW/pg2 = 0.001, perf/data_wait = 0.1"
    assert figure.get_suptitle() == f"run\n{flat_line}"

    other = {
        name: Series(s.steps, [2e-3] * len(s.values)) if name.startswith("lr-") else s for name, s in metrics.items()
    }
    overlay = draw_overlay({"a": metrics, "b": other}, "sweep")  # constant in each run, but not the same
    assert "learning rate" in [ax.get_title() for ax in overlay.axes]
    assert overlay.get_suptitle() == "sweep\nconstant, not drawn: perf/data_wait = 0.1"
    flat = {name: Series(s.steps, [1.0] * len(s.values)) for name, s in metrics.items()}
    assert len(draw_run(flat, "dead").axes) == len(panels(flat))  # nothing varies: all drawn, none named


def test_a_run_gets_one_png_written_atomically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs" / "clm_tiny"
    write_metrics(run, training_rows(range(30), 4.0) + training_rows(range(20, 40), 3.0))

    main([str(run)])

    curves = run / "plots" / "curves.png"
    assert capsys.readouterr().out.splitlines() == [str(curves)]
    assert_png(curves)
    assert os.listdir(run / "plots") == ["curves.png"]  # no temporary file left behind


def test_a_failed_write_leaves_no_file_under_the_final_name(tmp_path: Path, monkeypatch) -> None:
    write_metrics(tmp_path, training_rows(range(20), 4.0))

    def half_write(self, fname, **kwargs) -> None:
        Path(fname).write_bytes(PNG_SIGNATURE)
        raise OSError("disk full")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", half_write)
    with pytest.raises(OSError, match="disk full"):
        plot(tmp_path)
    assert not (tmp_path / "plots" / "curves.png").exists()
    assert os.listdir(tmp_path / "plots") == []


def test_a_multirun_gets_a_png_per_job_and_an_overlay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "multiruns" / "clm_tiny-lr"
    jobs = make_sweep(sweep, ["0.001", "0.003"])

    main([str(sweep)])

    expected = [job / "plots" / "curves.png" for job in jobs] + [sweep / "plots" / "overlay.png"]
    assert capsys.readouterr().out.splitlines() == [str(path) for path in expected]
    for path in expected:
        assert_png(path)
    assert run_labels(jobs) == ["0: model.optimizer.lr=0.001", "1: model.optimizer.lr=0.003"]


def test_out_puts_the_figures_elsewhere(tmp_path: Path) -> None:
    make_sweep(tmp_path / "sweep", ["0.001", "0.003"])

    written = plot(tmp_path / "sweep", tmp_path / "figures")

    figures = tmp_path / "figures"
    assert written == [figures / "0" / "curves.png", figures / "1" / "curves.png", figures / "overlay.png"]
    assert not list((tmp_path / "sweep").rglob("plots"))


def test_the_overlay_is_a_function_of_its_own(tmp_path: Path) -> None:
    jobs = make_sweep(tmp_path / "sweep", ["0.001", "0.003"])
    assert_png(plot_overlay(jobs, tmp_path / "report" / "overlay.png", labels=["low", "high"], title="lr"))


def test_a_run_without_rows_is_left_out_of_a_multirun(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jobs = make_sweep(tmp_path, ["0.001", "0.003"])
    write_metrics(jobs[1], [])

    written = plot(tmp_path)

    assert written == [jobs[0] / "plots" / "curves.png", tmp_path / "plots" / "overlay.png"]
    assert "has a header but no rows" in caplog.text and "left out" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no csv/metrics.csv under {dir}: pass a run directory such as logs/train/runs/<run>"),
        ("", "metrics.csv is empty: the run has not logged any metrics yet"),
        (",".join(COLUMNS) + "\n", "metrics.csv has a header but no rows"),
        ("epoch,step\n0,0\n", "metrics.csv has no metric to plot"),
    ],
    ids=["no-metrics-file", "empty", "header-only", "no-metric"],
)
def test_nothing_to_plot_is_an_error_that_says_what(tmp_path: Path, content: str | None, message: str) -> None:
    (tmp_path / "wandb").mkdir()
    if content is not None:
        (tmp_path / "csv").mkdir()
        (tmp_path / "csv" / "metrics.csv").write_text(content)
    with pytest.raises(SystemExit, match="^pretrain-plot: .*" + re.escape(message.format(dir=tmp_path))):
        main([str(tmp_path)])


def test_not_a_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a directory: pass a run directory"):
        main([str(tmp_path / "missing")])


def test_make_plot_runs_pretrain_plot_and_needs_run(tmp_path: Path) -> None:
    # The installed console script appears on the next `make install`; a stand-in runs the module.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pretrain-plot").write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "from pretraining.extras.plots.cli import main; main()" "$@"\n'
    )
    (bin_dir / "pretrain-plot").chmod(0o755)
    run = tmp_path / "run"
    write_metrics(run, training_rows(range(20), 4.0))
    env = os.environ | {"PYTHONPATH": str(SRC)}
    make = ["make", "-C", str(PROJECT_ROOT), "-o", "install", f"BIN={bin_dir}", "plot"]  # -o: leave the venv alone

    missing = subprocess.run(make, capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "usage: make plot RUN=" in missing.stdout

    result = subprocess.run([*make, f"RUN={run}"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert str(run / "plots" / "curves.png") in result.stdout
    assert_png(run / "plots" / "curves.png")


def test_plots_of_a_real_training_run(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.log_every_n_steps=2"))

    metrics = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert metrics["val/loss"].steps == [0, 6, 12]
    assert {"train/loss", "val/bpb", "perf/tokens_per_s", "perf/data_wait"} <= set(metrics)
    assert any(name.startswith("lr-") for name in metrics)
    assert plot(tmp_path) == [tmp_path / "plots" / "curves.png"]
    assert_png(tmp_path / "plots" / "curves.png")


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match=r"needs the optional dependencies of the 'plots' extra: pip install"):
        main([str(tmp_path)])
