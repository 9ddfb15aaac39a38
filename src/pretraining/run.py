"""The set-up and end of one training run, for `pretraining.train`: the checks across config
groups, the process, the run's lineage, the Trainer with its batch plan, whether the checkpoint it
continues from fits, the validations around fit, and the report. Which checkpoint a run continues from
is `pretraining.resume`'s."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from pretraining.callbacks import Lineage, Preemption
from pretraining.callbacks.lineage import code_revision
from pretraining.callbacks.preemption import Preempted
from pretraining.checkpoint import checkpoint_digest, parameter_shapes
from pretraining.config import PROJECT_ROOT, redact_secrets
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError, MissingExtraError
from pretraining.hf.init_from import initialise_from, is_origin
from pretraining.instantiate import build
from pretraining.launch import check_devices, hydra_quote
from pretraining.loggers import ResumableCSVLogger, wandb_sync_hint
from pretraining.objectives import PretrainingObjective
from pretraining.objectives.base import check_lengths
from pretraining.quiet import set_up_messages
from pretraining.registry.versions import Registry, check_not_tainted
from pretraining.resume import Resume, check_fits
from pretraining.schema import check_schema
from pretraining.settings import TrainSettings

# The values configs leave to you (`???`), and what to pass: named before anything reads them, since other
# groups interpolate some (data.dir in tokenizer.path) and OmegaConf alone would name the wrong key.
LEFT_TO_YOU = {
    "data.dir": "data.dir=<shard directory> (built with `pretrain-data build --out <dir>`, plus "
    "`pretrain-data tokenizer --data <dir>` for tokenizer=bpe)",
    "model.teacher": "model.teacher=<a trained checkpoint, or a registry alias or version: pretrain-registry list>",
}


def check_config(cfg: DictConfig) -> None:
    """Stop before any work if a value does not fit the schema (`pretraining.schema`), or values from
    different groups contradict each other."""
    for key, fix in LEFT_TO_YOU.items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent)
        if node is not None and OmegaConf.is_missing(node, leaf):
            raise ConfigError(f"{key} is not set: pass {fix}")
    check_schema(cfg, TrainSettings, "configs/train.yaml")
    loggers = cfg.logger or {}
    if "tensorboard" in loggers and not any(importlib.util.find_spec(m) for m in ("tensorboardX", "tensorboard")):
        raise MissingExtraError("logger=tensorboard", "tensorboard")
    if cfg.trainer.max_steps <= 0:
        raise ConfigError(
            f"trainer.max_steps={cfg.trainer.max_steps}: set it > 0 (the LR schedule and the infinite stream need it)"
        )
    if "accumulate_grad_batches" in cfg.trainer:
        raise ConfigError(
            "trainer.accumulate_grad_batches is derived, not set: the accumulation is data.global_batch_size / "
            "(devices x data.micro_batch_size); set data.micro_batch_size to what fits on one device instead"
        )


def prepare_process(cfg: DictConfig) -> None:
    """Show Lightning's messages once and quiet the libraries (unless `quiet=false`), refuse GPUs this
    node lacks, set the float32 matmul precision and seed every generator."""
    set_up_messages(cfg.quiet)
    check_devices(cfg.trainer)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    seed_everything(cfg.seed, workers=True, verbose=not cfg.quiet)


def fit_warmup(cfg: DictConfig) -> None:
    """Shorten a warmup that is not below the run's steps (the default's 30 in a smoke run of 20) to a
    tenth of the run, saying so: the schedule still warms up, then decays. The run's lineage records the
    warmup it used."""
    max_steps, warmup_steps = cfg.trainer.max_steps, cfg.model.warmup_steps
    if warmup_steps < max_steps:
        return
    cfg.model.warmup_steps = shortened = max_steps // 10
    instead = f"warming up for {counted(shortened, 'step')} (a tenth of the run)" if shortened else "no warmup"
    rank_zero_info(
        f"model.warmup_steps={warmup_steps} is not below trainer.max_steps={max_steps}: {instead} instead; "
        "set model.warmup_steps to choose"
    )


def describe_model(model: PretrainingObjective) -> None:
    """One line in place of Lightning's model summary (off: its FLOPs column cannot count ours)."""
    backbone = model.backbone
    count = sum(parameter.numel() for parameter in model.parameters())
    rank_zero_info(
        f"model: {type(model).__name__}, {count / 1e6:.2f}M parameters ({counted(backbone.n_layer, 'layer')} of width "
        f"{backbone.d_model}, {backbone.n_head} heads, vocabulary {backbone.vocab_size}, "
        f"{backbone.max_seq_len} positions)"
    )


def counted(count: int, noun: str) -> str:
    """`3 layers`, `1 layer`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def check_example_lengths(cfg: DictConfig, tokenizer: Tokenizer) -> None:
    """Refuse examples longer than the model's positions before the data is read (its checksums can take
    minutes): the example format alone, built here, knows its lengths."""
    check_lengths(build(cfg.data.format)(tokenizer), cfg.model.backbone.max_seq_len)


def starting_weights(
    model: PretrainingObjective, tokenizer: Tokenizer, resume: Resume | None, cfg: DictConfig
) -> dict[str, Any] | None:
    """Load `model.init_from` into a fresh run's backbone; the record of where the weights started (a
    resumed run's, from its checkpoint: the directory need not exist any more), or None. An export of a
    checkpoint tainted in the registry is refused unless `allow_tainted`."""
    if resume is not None:
        origin = resume.sidecar.get("lineage", {}).get("origin")
        check_same_origin(model.init_from, origin, resume.path)
        return origin
    if model.init_from is None:
        return None
    origin = initialise_from(model.backbone, model.init_from, tokenizer)
    exported = (origin["exported_from"] or {}).get("checkpoint_sha256")
    if exported and not cfg.allow_tainted:
        what = f"model.init_from={model.init_from} (exported from {origin['exported_from']['checkpoint']})"
        check_not_tainted(
            Registry(cfg.paths.registry_dir), checkpoint_digest(exported), what, "a start", "allow_tainted=true"
        )
    rank_zero_info(f"starting from the weights of {origin['init_from']} (model.init_from)")
    return origin


def check_same_origin(init_from: str | None, origin: dict[str, Any] | None, checkpoint: Path) -> None:
    """Refuse a `model.init_from` that the run being continued did not start from: its checkpoint's weights
    win, and the lineage would name a start that never happened. The directory is named as it was then,
    or as the same place now (it need not exist any more)."""
    if init_from is None or (origin and is_origin(init_from, origin)):
        return
    started = f"model.init_from={origin['given']}" if origin else "no model.init_from (random weights)"
    raise ConfigError(
        f"model.init_from={init_from} applies to a fresh run, and this one continues from {checkpoint}, whose run "
        f"started from {started}: pass that to continue it, or resume=never (or another run_name) to start "
        f"afresh from {init_from}"
    )


def run_lineage(
    cfg: DictConfig,
    datamodule: ShardDataModule,
    resume: Resume | None,
    origin: dict[str, Any] | None,
    teacher: dict[str, Any] | None,
) -> Lineage:
    """The callback that stamps every checkpoint with what produced it: the config (without credentials:
    it is logged and stored), the code revision, data and tokenizer, the checkpoint continued from, the
    weights the run started from (`origin`, from `starting_weights`) and the teacher it learns from."""
    config = cast(dict[str, Any], redact_secrets(OmegaConf.to_container(cfg, resolve=True)))
    parent = str(resume.path) if resume else None
    code = code_revision(PROJECT_ROOT)
    tokenizer = datamodule.tokenizer.fingerprint
    return Lineage(config, datamodule.manifest.version, tokenizer, code, parent, origin, teacher)


def build_trainer(cfg: DictConfig, datamodule: ShardDataModule, callbacks: list[Callback]) -> Trainer:
    """The configured Trainer, with the configured callbacks and loggers plus `callbacks`, and the gradient
    accumulation that makes the global batch. The accumulation follows from the number of devices, which
    Lightning resolves as it builds the Trainer (`devices=auto`, nodes, torchrun's environment): it is set
    right after, before anything runs, and a global batch the devices cannot share stops the run here."""
    configured = [build(callback) for callback in cfg.callbacks.values()]
    loggers: list[Logger] = [build(logger) for logger in cfg.logger.values()]
    trainer: Trainer = build(cfg.trainer, callbacks=configured + callbacks, logger=loggers, plugins=plugins(cfg))
    plan = datamodule.plan_for(trainer.world_size)
    rank_zero_info(
        f"global batch {plan.global_batch} = {trainer.world_size} devices x {plan.accumulation} micro-batches of "
        f"{plan.micro_batch}, drawn from {plan.streams} streams"
    )
    trainer.accumulate_grad_batches = plan.accumulation
    return trainer


def plugins(cfg: DictConfig) -> list[Any]:
    """The configured plugins, plus, under SLURM, its environment with Lightning's auto-requeue off:
    that saves inside the signal handler; `Preemption` saves at the step boundary instead."""
    configured = [build(plugin) for plugin in cfg.trainer.get("plugins") or []]
    if SLURMEnvironment.detect():
        configured.append(SLURMEnvironment(auto_requeue=False))
    return configured


def check_resume(
    trainer: Trainer, datamodule: ShardDataModule, model: PretrainingObjective, resume: Resume, allow: list[str]
) -> None:
    """Refuse, before any work, a checkpoint this strategy cannot read or that does not fit this run."""
    if resume.path.is_dir() and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise ConfigError(
            f"{resume.path} is a sharded checkpoint (a directory written by FSDP2), which only FSDP2 can resume: "
            f"pass trainer=fsdp_cpu (or another ModelParallelStrategy config) with as many processes as wrote it"
        )
    expected = {
        "data_version": datamodule.manifest.version,
        "tokenizer_fingerprint": datamodule.tokenizer.fingerprint,
        "topology": datamodule.topology_for(trainer.world_size),
    }
    check_fits(resume.path, resume.sidecar, expected, parameter_shapes(model.state_dict()), allow)


def log_hyperparameters(trainer: Trainer, lineage: Lineage) -> None:
    """The config and the lineage (without the config again), to every logger."""
    config = cast(dict[str, Any], lineage.record["config"])
    summary = {key: value for key, value in lineage.record.items() if key != "config"}
    for logger in trainer.loggers:  # not the configured ones: fast_dev_run swaps in a dummy
        logger.log_hyperparams({**config, "lineage": summary})


def fit(
    trainer: Trainer,
    model: PretrainingObjective,
    datamodule: ShardDataModule,
    validate_first: bool,
    resume: Resume | None,
    tables: bool = False,
) -> dict[str, float]:
    """Validate the untrained model (with `validate_first`: the start of the learning curve), fit (continuing
    from `resume`, if any), and validate the final weights unless the last step was validated
    or a signal stopped training; the final metrics. A signal during a validation ends it (`Preempted`);
    `report` then exits as after one during training. W&B's run is closed on the way out, so that the
    next job of a multirun starts its own. `tables`: Lightning's table of each validation's metrics too."""
    metrics: dict[str, float] = {}
    try:
        if validate_first:
            trainer.validate(model, datamodule=datamodule, verbose=tables)
        trainer.fit(model, datamodule=datamodule, ckpt_path=str(resume.path) if resume else None)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        if not signal_status(trainer) and model.last_validated_step != trainer.global_step:
            metrics |= trainer.validate(model, datamodule=datamodule, verbose=tables)[0]
    except Preempted:
        pass  # Preemption knows the signal, for `report`
    finally:
        finish_wandb()
    return metrics


def finished(resume: Resume, checkpoint_dir: Path, max_steps: int) -> bool:
    """Whether this run is complete: it continues from its own checkpoint (not one passed as `ckpt_path`)
    at `max_steps` or later, and that step was validated. Running a finished run again then starts
    nothing (no validation row twice, no second W&B run)."""
    step = resume.sidecar.get("step", -1)
    own = resume.path.resolve().parent == checkpoint_dir.resolve()
    if not own or step < max_steps or "validation" not in resume.sidecar:
        return False
    rank_zero_info(
        f"the run is complete: {resume.path} is its step {step} (trainer.max_steps={max_steps}), validated. "
        "Raise trainer.max_steps to train further, or pass resume=never to start over"
    )
    return True


def finish_wandb() -> None:
    import wandb  # loaded by the W&B logger already, if one is configured

    if wandb.run is not None:
        wandb.finish()


def command(script: str, *args: str | Path) -> str:
    """A shell command line running the console script `script`: the one beside this Python (`.venv/bin/...`),
    else the one on PATH."""
    beside = Path(sys.executable).parent / script
    return shlex.join([str(shown(beside)) if beside.exists() else script, *map(str, args)])


def override_value(path: Path) -> str:
    """`path` as the value of a Hydra override: as it is when Hydra reads it so, else quoted."""
    return str(path) if re.fullmatch(r"[A-Za-z0-9_./-]+", str(path)) else hydra_quote(str(path))


def export_name(run: Path) -> str:
    """A name for an export of `run`: its directory's, with its sweep's for a job of a multirun (`0`, `1`)."""
    return f"{run.parent.name}-{run.name}" if run.name.isdigit() else run.name


def shown(path: Path) -> Path:
    """`path` as the user will type it: relative to the current directory when it is below it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def signal_status(trainer: Trainer) -> int:
    """0, or 128 + the signal that stopped training (as the shell reports it), as `Preemption` saw it."""
    preemption = [c for c in trainer.callbacks if isinstance(c, Preemption)]  # type: ignore[attr-defined]
    return preemption[0].exit_code if preemption else 0


def report(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Where the run is, its last checkpoint and the commands for both (evaluate, info, export, plot: the
    console scripts, run from this directory), its final metrics and how to upload an offline W&B run;
    then, if a signal stopped it, exit with 128 + the signal's number (after saving)."""
    run = shown(Path(trainer.default_root_dir))
    lines = [f"run directory: {run}"]
    last = getattr(trainer.checkpoint_callback, "last_model_path", "")
    if last and Path(last).exists():
        last = shown(Path(last))
        lines += [
            f"last checkpoint: {last}",
            f"  evaluate it:    {command('pretrain-eval', f'ckpt_path={override_value(last)}')}",
            f"  what made it:   {command('pretrain-info', last)}",
            f"  export it:      {command('pretrain-export', last, Path('exports') / export_name(run))}",
        ]
    if any(isinstance(logger, ResumableCSVLogger) for logger in trainer.loggers):
        lines.append(f"learning curves: {command('pretrain-plot', run)}")
    lines += [
        f"{name} = {value:.0f}" if value.is_integer() else f"{name} = {value:.5g}"
        for name, value in sorted(metrics.items())
    ]
    hint = wandb_sync_hint(trainer.loggers)
    if hint:
        lines.append(f"W&B logged offline (no credentials, or WANDB_MODE=offline); upload the run with: {hint}")
    rank_zero_info("\n".join(lines))
    status = signal_status(trainer)
    if status:
        rank_zero_info(f"stopped by a signal at step {trainer.global_step}; run the same command to continue")
        raise SystemExit(status)
