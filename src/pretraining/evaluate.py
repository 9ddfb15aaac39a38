"""Evaluation: validate a checkpoint and sample from it (`pretraining.cli.evaluate` composes the config).

    pretrain-eval ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt

The model, tokenizer and data come from the config stored in the checkpoint
(its lineage), so a checkpoint is evaluated the way it was trained. A sharded
checkpoint (a directory, from FSDP2) is evaluated the same way, on one process.
Nothing in the checkpoint can run code: its tensors load weights-only, and its
config may build only classes of this package (`pretraining.instantiate`) and
those you trust: `trusted_targets=[my_project.objectives]`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from omegaconf import DictConfig

from pretraining.callbacks.numerics import NumericalError, nonfinite_validation
from pretraining.callbacks.text_sample import NO_SAMPLE, sample_text
from pretraining.data.manifest import Manifest
from pretraining.instantiate import build
from pretraining.objectives.base import PretrainingObjective, logged_values
from pretraining.objectives.causal_lm import CausalLM
from pretraining.quiet import set_up_messages
from pretraining.schema import check_schema
from pretraining.settings import EvalSettings
from pretraining.stored import load_checkpoint, rebuilding, stored_model


def build_from_checkpoint(
    checkpoint: dict[str, Any],
    source: str,
    data_overrides: dict[str, Any],
    tokenizer_path: str | None = None,
    trusted_targets: Sequence[str] = (),
) -> tuple[PretrainingObjective, Any]:
    """The objective (with the checkpoint's weights) and the DataModule the checkpoint was trained with."""
    model, run, examples = stored_model(checkpoint, source, tokenizer_path, trusted_targets)
    directory = data_overrides.get("dir", run.data.get("dir"))
    with rebuilding(checkpoint, source):
        if directory is not None:  # read first to name this command's keys in a refusal, not pretrain's data.dir
            Manifest.load(
                directory,
                check=False,
                key="data_dir",
                trust_pipe_commands=data_overrides.get("trust_pipe_commands", False),
                trust_option="trust_pipe_commands=true",
            )
        if directory is not None and run.data.get("sources") is not None:
            data_overrides = data_overrides | {"sources": None}  # data_dir stands for the run's mixture
        return model, build(run.data, tokenizer=examples.tokenizer, **data_overrides)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Validation metrics of `cfg.ckpt_path` and a sample, also written to metrics.json (a non-finite value as null);
    a validation with non-finite values then raises `NumericalError`."""
    check_schema(cfg, EvalSettings, "configs/eval.yaml")
    set_up_messages(cfg.quiet)
    checkpoint = load_checkpoint(cfg.ckpt_path)
    overrides = {key: value for key, value in (("dir", cfg.data_dir), ("val_size", cfg.val_size)) if value is not None}
    overrides["trust_pipe_commands"] = cfg.trust_pipe_commands  # the command line's word, never the stored one
    trusted = list(cfg.trusted_targets)
    model, datamodule = build_from_checkpoint(checkpoint, str(cfg.ckpt_path), overrides, cfg.tokenizer_path, trusted)
    model.restored_step = checkpoint["global_step"]  # the step its messages name
    # The command line's callbacks (callbacks=<group>, e.g. a downstream evaluation), never the stored config's.
    callbacks = [build(node) for node in (cfg.callbacks or {}).values()]
    trainer = Trainer(
        accelerator=cfg.accelerator, devices=1, logger=False, enable_checkpointing=False, callbacks=callbacks
    )
    # One result per validation loader (a mixture has one per source), each holding every metric: the objective
    # logs them all at the epoch's end.
    validated = trainer.validate(model, datamodule=datamodule, verbose=not cfg.quiet)[0]
    metrics = logged_values(validated)  # the checkpoint's step is below
    result: dict[str, Any] = {"checkpoint": str(cfg.ckpt_path), "step": checkpoint["global_step"], **metrics}
    if cfg.prompt and isinstance(model, CausalLM):
        torch.manual_seed(cfg.seed)
        result["sample"] = sample_text(
            model, datamodule.tokenizer, cfg.prompt, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k
        )
    if datamodule.data_version != checkpoint["lineage"]["data_version"]:
        result["note"] = "evaluated on a different data version than the checkpoint was trained on"
    out = Path(cfg.paths.output_dir) / "metrics.json"
    out.write_text(json.dumps({key: json_value(value) for key, value in result.items()}, indent=2) + "\n")
    for key, value in result.items():
        print(
            f"{key}: {value}"
            if key != "sample"
            else f"sample:\n{'-' * 60}\n{NO_SAMPLE if value is None else value}\n{'-' * 60}"
        )
    nonfinite = nonfinite_validation(metrics)
    if nonfinite:
        raise NumericalError(
            f"{cfg.ckpt_path}: the validation gave non-finite values {nonfinite} (written to {out} as null): the "
            f"checkpoint's weights, or its settings, make NaN or infinite values, so it has no result to compare"
        )
    return result


def json_value(value: Any) -> Any:
    """A value for strict JSON: a non-finite number as null (JSON has no NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
