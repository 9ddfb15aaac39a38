"""Hydra entry point for training: compose, instantiate, fit (or continue), report.

pretrain experiment=clm_tiny trainer.max_steps=50

Running the same command again continues the run from its newest verified
checkpoint (see `pretraining.resume`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import hydra
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from pretraining.callbacks import Lineage, Preemption, SkippedSamples
from pretraining.callbacks.lineage import code_revision
from pretraining.checkpoint import parameter_shapes
from pretraining.config import CONFIG_DIR, PROJECT_ROOT, ConfigError, build, check_config, redact_secrets
from pretraining.launch import check_devices, distributed_job
from pretraining.loggers import wandb_sync_hint
from pretraining.objectives import build_objective
from pretraining.resume import check_fits, checkpoint_to_resume


def train(cfg: DictConfig) -> dict[str, float]:
    """Train as `cfg` says (continuing the run if it has a checkpoint); return the final metrics.

    Exits with 128 + the signal number if a signal stopped training (after saving).
    """
    check_config(cfg)
    check_devices(cfg.trainer)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    seed_everything(cfg.seed, workers=True)
    resume = checkpoint_to_resume(cfg.resume, cfg.ckpt_path, Path(cfg.paths.output_dir), Path(cfg.paths.checkpoint_dir))
    tokenizer = build(cfg.tokenizer)
    datamodule = build(cfg.data, tokenizer=tokenizer)
    model = build_objective(cfg.model, tokenizer, datamodule.kind)

    # Logged and stored in every checkpoint, so without credentials.
    config = cast(dict[str, Any], redact_secrets(OmegaConf.to_container(cfg, resolve=True)))
    parent = str(resume[0]) if resume else None
    lineage = Lineage(config, datamodule.manifest.version, tokenizer.fingerprint, code_revision(PROJECT_ROOT), parent)
    callbacks = [build(callback) for callback in cfg.callbacks.values()] + [lineage, SkippedSamples()]
    loggers: list[Logger] = [build(logger) for logger in cfg.logger.values()]
    trainer: Trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers, plugins=trainer_plugins(cfg))
    trainer.accumulate_grad_batches = plan_batches(datamodule, trainer.world_size)
    if resume:
        check_resumable(trainer, resume[0])
        expected = {
            "data_version": datamodule.manifest.version,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "topology": datamodule.topology_for(trainer.world_size),
        }
        check_fits(resume[0], resume[1], expected, parameter_shapes(model.state_dict()), list(cfg.resume_allow))
    for logger in trainer.loggers:  # not `loggers`: fast_dev_run swaps in a dummy
        logger.log_hyperparams({**config, "lineage": {k: v for k, v in lineage.record.items() if k != "config"}})

    try:
        if cfg.validate_before_training and not resume:
            trainer.validate(model, datamodule=datamodule)  # the starting point of the learning curve
        trainer.fit(model, datamodule=datamodule, ckpt_path=parent)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        preemption = [c for c in trainer.callbacks if isinstance(c, Preemption)]  # type: ignore[attr-defined]
        stopped_by = preemption[0].exit_code if preemption else 0
        if not stopped_by and model.last_validated_step != trainer.global_step:  # final weights are validated
            metrics |= trainer.validate(model, datamodule=datamodule)[0]
    finally:
        finish_wandb()
    report(trainer, metrics)
    if stopped_by:
        rank_zero_info(f"stopped by a signal at step {trainer.global_step}; run the same command to continue")
        raise SystemExit(stopped_by)
    return metrics


def plan_batches(datamodule: Any, world_size: int) -> int:
    """The gradient accumulation that makes the configured global batch on `world_size` devices
    (refusing, before any work, a global batch the devices cannot share evenly)."""
    plan = datamodule.plan_for(world_size)
    rank_zero_info(
        f"global batch {plan.global_batch} = {world_size} devices x {plan.accumulation} micro-batches of "
        f"{plan.micro_batch}, drawn from {plan.streams} streams"
    )
    return plan.accumulation


def trainer_plugins(cfg: DictConfig) -> list[Any]:
    """The configured plugins, plus, under SLURM, its environment with Lightning's auto-requeue off:
    that saves inside the signal handler; `Preemption` saves at the step boundary instead."""
    plugins = [build(plugin) for plugin in cfg.trainer.get("plugins") or []]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


def check_resumable(trainer: Trainer, checkpoint: Path) -> None:
    """Refuse, before any work, a sharded checkpoint under a strategy that cannot read one."""
    if checkpoint.is_dir() and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise ConfigError(
            f"{checkpoint} is a sharded checkpoint (a directory written by FSDP2), which only FSDP2 can resume: "
            f"pass trainer=fsdp_cpu (or another ModelParallelStrategy config) with as many processes as wrote it"
        )


def finish_wandb() -> None:
    """Close the W&B run so that the next job of a multirun starts its own."""
    import wandb

    if wandb.run is not None:
        wandb.finish()


def report(trainer: Trainer, metrics: dict[str, float]) -> None:
    output_dir = Path(trainer.default_root_dir)
    lines = [f"run directory: {output_dir}"]
    last = getattr(trainer.checkpoint_callback, "last_model_path", "")
    if last and Path(last).exists():
        lines += [f"last checkpoint: {last}", f"evaluate it: make eval CKPT={last}"]
    lines += [f"{name} = {value:.4f}" for name, value in sorted(metrics.items())]
    hint = wandb_sync_hint(trainer.loggers)
    if hint:
        lines.append(f"W&B logged offline (no credentials, or WANDB_MODE=offline); upload the run with: {hint}")
    rank_zero_info("\n".join(lines))


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    with distributed_job():  # each job of a multirun is a distributed job of its own
        metrics = train(cfg)
    # A sweeper optimises the value returned here.
    return metrics.get(cfg.get("optimized_metric") or "", None)


if __name__ == "__main__":
    main()
