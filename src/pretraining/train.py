"""Training: check, build, fit (or continue), report; `pretrain experiment=clm_tiny trainer.max_steps=50`
(`pretraining.cli.train` composes the config and calls `train_job`). The same command again continues the run
(`pretraining.resume`); the steps between are `pretraining.run`'s, the end `pretraining.report`'s."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pretraining.callbacks.data_counts import DataCounts
from pretraining.callbacks.numerics import check_result
from pretraining.checkpoint import storage_faults_stop_the_run
from pretraining.instantiate import build
from pretraining.job_status import work_begins
from pretraining.launch import distributed_job, is_rank_zero_process
from pretraining.objectives.base import build_objective
from pretraining.report import report
from pretraining.resume import checkpoint_to_resume, start_over
from pretraining.run import (
    build_trainer,
    check_config,
    check_example_lengths,
    check_resume,
    describe_model,
    finished,
    fit,
    fit_schedule,
    log_hyperparameters,
    prepare_process,
    run_lineage,
    validation_owed,
)
from pretraining.run_lock import own_run_directory


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says, continuing the run if it has a checkpoint; return the final metrics, or exit 128 + the
    signal number if a signal stopped training (after saving). A run with no finite result raises `NumericalError`
    (`check_result`); a start refused before its work leaves the run's status record as it was (`work_begins`)."""
    check_config(cfg)
    prepare_process(cfg)
    fit_schedule(cfg)  # a smoke run shorter than the default warmup (or wsd decay)
    run_dir, checkpoints = Path(cfg.paths.output_dir), Path(cfg.paths.checkpoint_dir)
    resume = checkpoint_to_resume(cfg.resume, cfg.ckpt_path, checkpoints)
    tokenizer = build(cfg.tokenizer)
    check_example_lengths(cfg, tokenizer)
    datamodule = build(cfg.data, tokenizer=tokenizer)
    model = build_objective(cfg.model, datamodule.format)
    describe_model(model)
    if cfg.resume == "never":
        work_begins()  # the earlier run's outputs go aside: its record describes them no more
        start_over(run_dir)  # only now: a start refused above leaves the earlier run in place
    lineage = run_lineage(cfg, datamodule, resume)
    # Lineage stamps the checkpoints; DataCounts keeps to the bad-data policy and logs what the data gave.
    trainer = build_trainer(cfg, datamodule, callbacks=[lineage, DataCounts()])
    if resume:
        check_resume(trainer, datamodule, model, resume, list(cfg.resume_allow))
    work_begins()
    if resume and finished(resume, checkpoints, cfg.trainer.max_steps, cfg.model.get("schedule", "cosine")):
        metrics = dict(resume.sidecar["validation"])  # before a logger starts a run
        check_result(metrics, resume.sidecar["step"])
        return metrics
    log_hyperparameters(trainer, lineage)
    validate_first = validation_owed(trainer, resume, checkpoints) if resume else cfg.validate_before_training
    with storage_faults_stop_the_run(checkpoints):
        metrics = fit(trainer, model, datamodule, validate_first, resume, not cfg.quiet)
    report(trainer, metrics)
    check_result(metrics, trainer.global_step)  # after the summary, which shows the values
    return metrics


def train_job(cfg: DictConfig) -> float | None:
    """`pretrain`'s job (`pretraining.cli.train`): train; return the metric a sweeper optimises, if any."""
    # The job owns its directory before anything is written, and is a distributed job of its own.
    with job_lock(cfg), distributed_job():
        metrics = train(cfg)
    return metrics.get(cfg.get("optimized_metric") or "", None)


def job_lock(cfg: DictConfig) -> AbstractContextManager[object]:
    """The lock on the job's run directory, held by global rank zero: a DDP or FSDP job's other ranks (on any node)
    are that job, not a second one. A refused single run leaves no directory; a multirun's job leaves its status."""
    if not is_rank_zero_process():
        return nullcontext()
    single = HydraConfig.get().mode != RunMode.MULTIRUN
    return own_run_directory(Path(cfg.paths.output_dir), remove_if_refused=single)
