"""Sweeps: grid multiruns whose failed jobs do not stop the others, the Optuna sweeper's study and its
continuation, and the sweep report."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from plots.test_plots import make_sweep

from conftest import TINY_RUN
from pretraining.config import CONFIG_DIR
from pretraining.extras.sweeps.cli import main as report_main
from pretraining.extras.sweeps.report import SweepError, write_report
from pretraining.job_status import read_status, write_status

SHORT = [*TINY_RUN, "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=2"]


def multirun(log_dir: Path, data: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`pretrain -m` with tiny settings; the sweep directory is the only one under `log_dir`."""
    command = [sys.executable, "-m", "pretraining", "-m", *SHORT, f"data.dir={data}", f"paths.log_dir={log_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.run([*command, *overrides], capture_output=True, text=True, env=env, timeout=300)


def sweep_dir(log_dir: Path) -> Path:
    (directory,) = (log_dir / "train" / "multiruns").iterdir()
    return directory


def report_rows(directory: Path) -> list[dict[str, str]]:
    with (directory / "report.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def test_a_grid_runs_each_job_in_its_own_directory_and_the_report_lists_them(
    tmp_path: Path, small_shards: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = multirun(tmp_path, small_shards, "model.optimizer.lr=1e-3,3e-3")
    assert result.returncode == 0, result.stderr[-3000:]

    directory = sweep_dir(tmp_path)
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        assert f"model.optimizer.lr={lr}" in OmegaConf.load(directory / job / ".hydra" / "overrides.yaml")
        assert read_status(directory / job)["status"] == "completed"
        assert (directory / job / "checkpoints" / "step-000006.ckpt").is_file()
    rows = report_rows(directory)  # written by the sweep itself, after its last job
    assert sorted(row["job"] for row in rows) == ["0", "1"]
    assert {row["model.optimizer.lr"] for row in rows} == {"0.001", "0.003"}
    assert all(row["status"] == "completed" and row["step"] == "6" and float(row["val/bpb"]) > 0 for row in rows)
    assert float(rows[0]["val/bpb"]) <= float(rows[1]["val/bpb"])  # best first
    assert float(rows[0]["tokens/s"]) > 0
    assert (directory / "plots" / "overlay.png").stat().st_size > 0

    report_main([str(directory)])  # make sweep-report
    printed = capsys.readouterr().out
    assert "2 completed" in printed and "| 0 |" in printed and "| 1 |" in printed


def test_a_failed_job_is_recorded_and_the_others_still_run(tmp_path: Path, small_shards: Path) -> None:
    # Job 0's final LR ratio is out of range: it stops at its config check; job 1 must still run.
    result = multirun(tmp_path, small_shards, "model.min_lr_ratio=2,0.1")

    assert result.returncode != 0  # the sweep reports the failure ...
    assert "model.min_lr_ratio=2 must be in [0, 1]" in result.stderr
    directory = sweep_dir(tmp_path)
    failed, completed = read_status(directory / "0"), read_status(directory / "1")
    assert failed["status"] == "failed" and "ConfigError: model.min_lr_ratio=2" in failed["error"]
    assert completed["status"] == "completed"  # ... after running the rest
    assert (directory / "1" / "checkpoints" / "step-000006.ckpt").is_file()
    rows = report_rows(directory)
    assert [(row["job"], row["status"]) for row in rows] == [("1", "completed"), ("0", "failed")]
    assert "set model.min_lr_ratio within" in rows[1]["error"]


@pytest.mark.slow  # 36 s; the grid and failed-job sweeps stay in the default suite
def test_an_optuna_study_continues_from_its_storage(tmp_path: Path, small_shards: Path) -> None:
    search = [
        "hparams_search=clm",
        "model.optimizer.lr=tag(log, interval(1e-4, 1e-2))",
        "model.backbone.d_model=choice(16, 32)",
        "data.global_batch_size=choice(4, 8)",
    ]
    first = multirun(tmp_path, small_shards, *search, "hydra.sweeper.n_trials=2")
    assert first.returncode == 0, first.stderr[-3000:]
    directory = sweep_dir(tmp_path)
    storage = f"sqlite:///{directory / 'optuna.db'}"
    study = optuna.load_study(study_name=directory.name, storage=storage)
    assert [trial.state.name for trial in study.trials] == ["COMPLETE", "COMPLETE"]
    before = [(trial.params, trial.value) for trial in study.trials]
    # As if a sweep had been killed during its third trial: asked for, never told.
    interrupted = study.ask(study.trials[0].distributions)

    second = multirun(tmp_path, small_shards, *search, "hydra.sweeper.n_trials=4")
    assert second.returncode == 0, second.stderr[-3000:]

    trials = optuna.load_study(study_name=directory.name, storage=storage).trials
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 4
    assert [(trial.params, trial.value) for trial in trials[:2]] == before
    assert trials[2].params == interrupted.params  # the interrupted trial ran again, with its own values
    assert trials[3].params not in [trial.params for trial in trials[:3]]  # a continued study draws anew
    for trial in trials:
        job = directory / str(trial.number)
        status = read_status(job)
        assert status["status"] == "completed" and status["value"] == trial.value
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
        assert f"model.optimizer.lr={trial.params['model.optimizer.lr']}" in overrides
    rows = report_rows(directory)
    assert sorted(row["job"] for row in rows) == ["0", "1", "2", "3"]
    assert [float(row["val/bpb"]) for row in rows] == pytest.approx(sorted(trial.value for trial in trials), rel=1e-5)


# --- the sweeper's search space -----------------------------------------------------------------------------


def test_search_space_reads_hydras_sweep_syntax() -> None:
    from pretraining.extras.sweeps.optuna import search_space

    params = {"model.optimizer.lr": "tag(log, interval(1e-4, 1e-2))", "model.warmup_steps": "range(10, 70, 20)"}
    arguments = [
        "data.global_batch_size=choice(8, 16)",
        "model.warmup_steps=5",
        "seed=3",
        "x.width=tag(int, interval(2, 9))",
    ]

    space, fixed = search_space(params, arguments)

    assert space == {
        "model.optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
        "data.global_batch_size": optuna.distributions.CategoricalDistribution([8, 16]),
        "x.width": optuna.distributions.IntDistribution(2, 9),
    }
    assert fixed == ["model.warmup_steps=5", "seed=3"]  # the command line's fixed value wins over the preset's range
    assert search_space({"n": "range(10, 70, 20)"}, [])[0]["n"] == optuna.distributions.IntDistribution(10, 50, step=20)


def test_search_space_refuses_what_optuna_cannot_sample() -> None:
    from pretraining.extras.sweeps.optuna import search_space

    with pytest.raises(ValueError, match=r"x=range\(0.1,0.5,0.1\): an Optuna search space takes"):
        search_space({}, ["x=range(0.1,0.5,0.1)"])


def test_a_study_is_not_continued_with_another_search_space(tmp_path: Path) -> None:
    from pretraining.extras.sweeps.optuna import check_same_study, search_space

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    space, _ = search_space({"lr": "interval(0.1, 0.2)"}, [])
    study.tell(study.ask(space), 1.0)

    check_same_study(study, space, "minimize", storage)  # the same: continues
    with pytest.raises(ValueError, match="keep its search space to continue it"):
        check_same_study(study, search_space({"lr": "interval(0.1, 0.3)"}, [])[0], "minimize", storage)
    with pytest.raises(ValueError, match="was run to minimize, not to maximize"):
        check_same_study(study, space, "maximize", storage)


# --- the report ---------------------------------------------------------------------------------------------


def test_the_report_ranks_by_the_sweepers_direction_and_marks_dead_jobs_interrupted(tmp_path: Path) -> None:
    jobs = make_sweep(tmp_path, ["0.001", "0.003", "0.01"])  # val/loss ends at 5.0 + job number
    for number, job in enumerate(jobs):
        (job / ".hydra" / "config.yaml").write_text("optimized_metric: val/loss\n")
        write_status(job, {"status": "completed", "value": 5.0 + number})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_status(jobs[2], {**read_status(jobs[2]), "status": "running", "host": os.uname().nodename, "pid": dead.pid})
    (tmp_path / "multirun.yaml").write_text("hydra:\n  sweeper:\n    direction: maximize\n")

    report = write_report(tmp_path)

    header, rows = report.table()
    assert header[:4] == ["job", "status", "model.optimizer.lr", "val/loss"]
    assert [row[:2] for row in rows] == [["2", "interrupted"], ["1", "completed"], ["0", "completed"]]
    assert report.summary() == "2 completed, 1 interrupted"
    assert (tmp_path / "report.md").read_text().startswith(f"# Sweep {tmp_path.name}: 2 completed, 1 interrupted")


def test_the_report_names_the_peak_rates_each_job_ran_at(tmp_path: Path) -> None:
    """A sweep of lr_scale (or of lr) on the Muon preset: the report shows both rates, so what a key moved shows."""
    jobs = make_sweep(tmp_path, ["0.5", "2"])
    for job, scale in zip(jobs, (0.5, 2.0), strict=True):
        optimizer = {"_target_": "pretraining.objectives.optimizers.MuonAdamW", "lr": 3e-3, "muon_lr": 0.02}
        config = {"optimized_metric": "val/loss", "model": {"optimizer": {**optimizer, "lr_scale": scale}}}
        OmegaConf.save(config, job / ".hydra" / "config.yaml")
        (job / ".hydra" / "overrides.yaml").write_text(f"- experiment=clm_modern\n- model.optimizer.lr_scale={scale}\n")
        write_status(job, {"status": "completed"})

    header, rows = write_report(tmp_path).table()

    lr, muon_lr = header.index("peak lr"), header.index("peak muon_lr")
    assert sorted((row[lr], row[muon_lr]) for row in rows) == [("0.0015", "0.01"), ("0.006", "0.04")]
    assert "| peak lr | peak muon_lr |" in (tmp_path / "report.md").read_text()


def test_the_report_names_what_to_pass_for_a_directory_without_jobs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no job directories"):
        report_main([str(tmp_path)])
    with pytest.raises(SweepError, match="is not a directory"):
        write_report(tmp_path / "missing")


def test_status_records_are_json(tmp_path: Path) -> None:
    write_status(tmp_path, {"status": "completed", "value": 1.5})
    assert json.loads((tmp_path / "status.json").read_text()) == {"status": "completed", "value": 1.5}
    assert read_status(tmp_path / "elsewhere") == {"status": "unknown"}


@pytest.mark.parametrize("preset", ["clm", "clm_modern", "mlm", "contrastive"])
def test_each_search_preset_is_a_valid_space_over_existing_keys(preset: str) -> None:
    from pretraining.extras.sweeps.optuna import search_space

    experiment = {"clm": "clm_tiny", "mlm": "mlm_tiny", "contrastive": "contrastive_tiny"}.get(preset, preset)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", [f"experiment={experiment}", f"hparams_search={preset}"], return_hydra_config=True)

    space, fixed = search_space(dict(cfg.hydra.sweeper.params), [])

    assert len(space) >= 5 and not fixed
    for key, distribution in space.items():
        assert OmegaConf.select(cfg, key) is not None, f"{preset}: {key} is not a key of the config"
        if key == "model.backbone.d_model":  # every width must split into the heads
            assert all(width % cfg.model.backbone.n_head == 0 for width in distribution.choices)


# Imports what pretraining.extras.sweeps.report needs but the plots first (torchmetrics loads matplotlib where it
# finds it, and skips it where it is not installed), then hides matplotlib from the import of the plots.
WITHOUT_MATPLOTLIB = """
import sys
import pretraining.checkpoint, pretraining.launch
for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
    del sys.modules[name]
sys.modules["matplotlib"] = None
from pretraining.extras.sweeps import report
print(report.NO_PLOTS)
"""


def test_a_sweep_report_without_matplotlib_leaves_out_only_the_overlay() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_MATPLOTLIB], capture_output=True, text=True, check=True)
    assert "the sweep's overlay plot (matplotlib) needs the optional dependencies of the 'plots' extra" in done.stdout


def test_an_optuna_search_without_optuna_is_refused_before_any_job(tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['optuna'] = None\n")  # as if not installed
    command = [str(Path(sys.executable).parent / "pretrain"), "-m", "experiment=clm_tiny", "hparams_search=clm"]
    env = os.environ | {"PYTHONPATH": str(hide)}
    done = subprocess.run([*command, f"paths.log_dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "hparams_search (the Optuna sweeper) needs the optional dependencies of the 'sweeps' extra" in done.stderr
    assert not list(tmp_path.glob("train/multiruns/*/0")), "a job started"
