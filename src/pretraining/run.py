"""One training run's set-up, for `pretraining.train`: cross-group checks, the process, lineage, the Trainer and its
batch plan, the resumed checkpoint's fit, and the validations around fit. Which checkpoint a run continues from is
`pretraining.resume`'s; its closing report, `pretraining.report`'s."""

from __future__ import annotations

import importlib.util
import pydoc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, ListConfig, OmegaConf

from pretraining.callbacks.checkpoint import StepCheckpoint, validated_at
from pretraining.callbacks.lineage import Lineage, code_revision
from pretraining.callbacks.preemption import Preempted, stop_signal
from pretraining.checkpoint import parameter_shapes
from pretraining.config import PROJECT_ROOT, redact_secrets
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError, MissingExtraError, MissingFileError
from pretraining.instantiate import build
from pretraining.launch import check_devices, check_launcher_ranks
from pretraining.objectives.base import PretrainingObjective, check_lengths, logged_values
from pretraining.objectives.optimizers import is_muon
from pretraining.quiet import set_up_messages
from pretraining.resume import Resume, check_fits
from pretraining.schema import check_schema
from pretraining.settings import TrainSettings

# The fix for each `???` key, named before anything resolves: tokenizer.path interpolates data.dir, so OmegaConf
# would name the wrong key.
LEFT_TO_YOU = {
    "data.dir": "<shard directory> (built with `pretrain-data build --out <dir>`, plus "
    "`pretrain-data tokenizer --data <dir>` for tokenizer=bpe), or data.dir=null with a mixture in data.sources",
}
FILLED_BY_THE_RUN = {"model.backbone.vocab_size"}  # from the tokenizer, by `build_objective`


def check_config(cfg: DictConfig) -> None:
    """Stop before any work on an unset value, a schema misfit (`pretraining.schema`) or contradicting groups."""
    for key in sorted(set(unset_keys(cfg)) - FILLED_BY_THE_RUN):
        if not key.startswith("hydra."):  # Hydra's own, filled as the job starts
            raise ConfigError(f"{key} is not set: pass {key}={LEFT_TO_YOU.get(key, '<value>')}")
    accumulation = cfg.trainer.get("accumulate_grad_batches", 1)
    if accumulation != 1:  # before the schema, whose message would be about its value
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulation} is derived from data.micro_batch_size, not set: the "
            "accumulation is data.global_batch_size / (devices x data.micro_batch_size); set data.micro_batch_size "
            "to what fits on one device instead"
        )
    check_schema(cfg, TrainSettings, "configs/train.yaml")
    check_start(cfg)
    check_optimizer_fits_strategy(cfg)
    check_mixture_tokenizer(cfg)
    loggers = cfg.logger or {}
    if "tensorboard" in loggers and not any(importlib.util.find_spec(m) for m in ("tensorboardX", "tensorboard")):
        raise MissingExtraError("logger=tensorboard", "tensorboard")


def check_start(cfg: DictConfig) -> None:
    """Refuse two starting points (the core's init_from, the hf extra's init_from_hf); under resume=never, which
    moves the earlier run aside, one that is not there (before the move)."""
    starts = [key for key in ("init_from", "init_from_hf") if key in (cfg.callbacks or {})]
    if len(starts) > 1:
        raise ConfigError(f"callbacks.{' and callbacks.'.join(starts)} are two starting points: keep one")
    if starts and cfg.resume == "never" and not Path(path := cfg.callbacks[starts[0]].path).exists():
        raise MissingFileError(f"callbacks.{starts[0]}.path={path}: no such checkpoint, run or model directory")


def check_mixture_tokenizer(cfg: DictConfig) -> None:
    """Refuse a tokenizer path naming data.dir in a mixture, which has none: its sources share one named tokenizer."""
    tokenizer = cfg.get("tokenizer")
    unresolved = OmegaConf.to_container(tokenizer, resolve=False) if isinstance(tokenizer, DictConfig) else {}
    path = cast(dict[str, Any], unresolved).get("path")
    if cfg.data.get("sources") is not None and isinstance(path, str) and "${data.dir}" in path:
        raise ConfigError(
            f"tokenizer.path={path}, and a mixture (data.sources) has no data.dir: its sources share one tokenizer; "
            f"pass tokenizer.path=<tokenizer.json> (`pretrain-data tokenizer --data <dir>` trains one on a source)"
        )


def check_optimizer_fits_strategy(cfg: DictConfig) -> None:
    """Refuse Muon under FSDP: Muon orthogonalises each hidden matrix whole, and FSDP shards it over ranks."""
    if not is_muon(target_of(cfg.model.get("optimizer"))) or not shards_parameters(cfg):
        return
    raise ConfigError(
        "model/optimizer=muon needs whole matrices, and FSDP (trainer.strategy) shards them over ranks: choose "
        "trainer=ddp (or ddp_cpu, or one device), or model/optimizer=adamw"
    )


def shards_parameters(cfg: DictConfig) -> bool:
    """Whether the strategy shards parameters (FSDP1 or FSDP2), named as a `_target_` or a Lightning strategy name."""
    strategy = cfg.trainer.get("strategy")
    if isinstance(strategy, str):
        return "fsdp" in strategy or "model_parallel" in strategy
    target = target_of(strategy)
    return isinstance(target, type) and issubclass(target, FSDPStrategy | ModelParallelStrategy)


def target_of(node: Any) -> Any:
    """What a config node's `_target_` names (the schema checked that it imports), or None."""
    path = node.get("_target_") if isinstance(node, DictConfig) else None
    return pydoc.locate(path) if isinstance(path, str) else None


def unset_keys(node: DictConfig | ListConfig, prefix: str = "") -> Iterator[str]:
    """The keys under `node` whose value is `???`, read unresolved: an interpolation may need Hydra, or point at one."""
    keys: list[Any] = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    for key in keys:
        if OmegaConf.is_missing(node, key):
            yield f"{prefix}{key}"
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig | ListConfig):
            yield from unset_keys(node[key], f"{prefix}{key}.")


def prepare_process(cfg: DictConfig) -> None:
    """Messages (`quiet`), a check of this node's GPUs, the float32 matmul precision, and every seed."""
    set_up_messages(cfg.quiet)
    check_devices(cfg.trainer)
    check_launcher_ranks(cfg.trainer)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    seed_everything(cfg.seed, workers=True, verbose=not cfg.quiet)


def fit_schedule(cfg: DictConfig) -> None:
    """Fit the LR schedule into a run shorter than it, saying so: a warmup not below max_steps becomes a tenth of the
    run; a wsd decay that does not fit after it, the last fifth (or what the warmup leaves)."""
    max_steps, warmup_steps = cfg.trainer.max_steps, cfg.model.warmup_steps
    if warmup_steps >= max_steps:
        cfg.model.warmup_steps = shortened = max_steps // 10
        instead = f"warming up for {counted(shortened, 'step')} (a tenth of the run)" if shortened else "no warmup"
        rank_zero_info(
            f"model.warmup_steps={warmup_steps} is not below trainer.max_steps={max_steps}: {instead} instead; "
            "set model.warmup_steps to choose"
        )
    decay_steps, room = cfg.model.get("decay_steps"), max_steps - cfg.model.warmup_steps
    if cfg.model.get("schedule") == "wsd" and decay_steps is not None and decay_steps > room:
        cfg.model.decay_steps = shortened = max(1, min(max_steps // 5, room))
        rank_zero_info(
            f"model.decay_steps={decay_steps} does not fit in trainer.max_steps={max_steps} after "
            f"model.warmup_steps={cfg.model.warmup_steps}: decaying over the last {counted(shortened, 'step')} "
            "instead; set model.decay_steps to choose"
        )


def describe_model(model: PretrainingObjective) -> None:
    """One line in place of Lightning's model summary (off: its FLOPs column cannot count ours)."""
    count = sum(parameter.numel() for parameter in model.parameters())
    rank_zero_info(f"model: {type(model).__name__}, {count / 1e6:.2f}M parameters ({model.backbone.describe()})")


def counted(count: int, noun: str) -> str:
    """`3 layers`, `1 layer`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def check_example_lengths(cfg: DictConfig, tokenizer: Tokenizer) -> None:
    """Refuse examples longer than the model's positions before the slow data checks; only the format knows lengths."""
    check_lengths(build(cfg.data.format)(tokenizer), cfg.model.backbone.max_seq_len)


def run_lineage(cfg: DictConfig, datamodule: ShardDataModule, resume: Resume | None) -> Lineage:
    """The callback stamping every checkpoint with its provenance: config (credentials redacted: it is logged and
    stored), code revision, data, tokenizer, and the checkpoint continued from."""
    config = cast(dict[str, Any], redact_secrets(OmegaConf.to_container(cfg, resolve=True)))
    parent = str(resume.path) if resume else None
    origin = resume.sidecar.get("lineage", {}).get("origin") if resume else None
    code = code_revision(PROJECT_ROOT)
    return Lineage(config, datamodule.data_version, datamodule.tokenizer.fingerprint, code, parent, origin)


def build_trainer(cfg: DictConfig, datamodule: ShardDataModule, callbacks: list[Callback]) -> Trainer:
    """The configured Trainer, with the accumulation that makes the global batch over its processes. Lightning
    works the processes out as it builds a Trainer (`devices=auto`, nodes, a launcher's environment) and takes the
    accumulation (and the validation interval, which it counts in micro-batches) only in the constructor: a bare
    Trainer of the same config tells them first. A global batch they cannot share stops the run here."""
    configured = model_checkpoints_first([build(callback) for callback in cfg.callbacks.values()])
    loggers: list[Logger] = [build(logger) for logger in cfg.logger.values()]
    environment = plugins(cfg)
    world = build(cfg.trainer, logger=False, plugins=environment).world_size
    plan = datamodule.plan_for(world)
    rank_zero_info(
        f"global batch {plan.global_batch} = {world} devices x {plan.accumulation} micro-batches of "
        f"{plan.micro_batch}, drawn from {plan.streams} streams"
    )
    every = cfg.trainer.get("val_check_interval")  # Lightning counts micro-batches: a validation ends a step
    steps = {"val_check_interval": every * plan.accumulation} if isinstance(every, int) else {}
    return build(
        cfg.trainer,
        callbacks=callbacks + configured,
        logger=loggers,
        plugins=environment,
        accumulate_grad_batches=plan.accumulation,
        **steps,
    )


def model_checkpoints_first(callbacks: list[Callback]) -> list[Callback]:
    """`callbacks` with Lightning's `ModelCheckpoint`s before `StepCheckpoint`, which saves their state: Lightning
    runs checkpoint callbacks last in the order given, and one after it would resume a validation behind."""
    saver = next((index for index, c in enumerate(callbacks) if isinstance(c, StepCheckpoint)), len(callbacks))
    later = [c for c in callbacks[saver:] if isinstance(c, ModelCheckpoint)]
    return [*callbacks[:saver], *later, *(c for c in callbacks[saver:] if c not in later)]


def plugins(cfg: DictConfig) -> list[Any]:
    """The configured plugins, plus SLURM's environment with auto-requeue off: that saves inside the signal handler,
    `Preemption` at the step boundary. Not for torchrun inside a SLURM job: its ranks are torchrun's."""
    configured = [build(plugin) for plugin in cfg.trainer.get("plugins") or []]
    if SLURMEnvironment.detect() and not TorchElasticEnvironment.detect():
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
    expected: dict[str, Any] = {"data_version": datamodule.data_version}
    expected["tokenizer_fingerprint"] = datamodule.tokenizer.fingerprint
    expected |= {"topology": datamodule.topology_for(trainer.world_size), "mixture": datamodule.mixture_settings}
    expected["parametrization"] = model.backbone.parametrization.record()
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
    """Fit, and return the final metrics. `validate_first` validates the starting weights (the curve's start, or the
    step a resumed run owes, `validation_owed`); a run reaching max_steps unstopped is validated at its end unless that
    step was. A signal during a validation raises `Preempted`; `report` exits as for one in training. W&B's run closes
    on the way out, so a multirun's next job starts its own. `tables`: Lightning's metric tables too."""
    metrics: dict[str, float] = {}
    ckpt_path = str(resume.path) if resume else None
    try:
        if validate_first:
            trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=tables)
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = logged_values(trainer.callback_metrics)
        if not metrics and resume:  # a run that stays stopped (EarlyStopping, `StepCheckpoint`) logs nothing
            metrics = dict(resume.sidecar.get("validation", {}))
        complete = trainer.global_step >= (trainer.max_steps or 0) and not stop_signal(trainer)
        if complete and model.last_validated_step != trainer.global_step:
            metrics |= logged_values(trainer.validate(model, datamodule=datamodule, verbose=tables)[0])
    except Preempted:
        pass  # Preemption knows the signal, for `report`
    finally:
        finish_wandb()
    return metrics


def validation_owed(trainer: Trainer, resume: Resume, checkpoint_dir: Path) -> bool:
    """Whether the run's own checkpoint is of a step validated in training whose validation did not finish (a signal
    saved it before, or inside, the validation): Lightning resumes it as if it had run. The last step is validated
    after `fit` anyway."""
    step = resume.sidecar["step"]
    own = resume.path.resolve().parent == checkpoint_dir.resolve()
    return (
        own
        and validated_at(trainer, step)
        and 0 < step < (trainer.max_steps or 0)
        and "validation" not in resume.sidecar
    )


def finished(resume: Resume, checkpoint_dir: Path, max_steps: int, schedule: str = "cosine") -> bool:
    """Whether this run is complete: resumed from its own checkpoint (not `ckpt_path`) at max_steps or later, and
    validated; running it again then starts nothing (no second validation row or W&B run)."""
    step = resume.sidecar.get("step", -1)
    own = resume.path.resolve().parent == checkpoint_dir.resolve()
    if not own or step < max_steps or "validation" not in resume.sidecar:
        return False
    further = (
        "To train further, continue a checkpoint from before its LR decay (ckpt_path=...) with a larger "
        "trainer.max_steps (model.schedule=wsd: its decay has run)"
        if schedule == "wsd"
        else "Raise trainer.max_steps to train further"
    )
    rank_zero_info(
        f"the run is complete: {resume.path} is its step {step} (trainer.max_steps={max_steps}), validated. "
        f"{further}, or pass resume=never to start over"
    )
    return True


def finish_wandb() -> None:
    import wandb  # loaded by the W&B logger already, if one is configured

    if wandb.run is not None:
        wandb.finish()
