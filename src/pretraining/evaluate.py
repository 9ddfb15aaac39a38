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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch import Trainer
from omegaconf import DictConfig, OmegaConf

from pretraining.checkpoint import READABLE_LINEAGE_FORMATS, load_sharded, load_weights_only, sidecar_path, verify
from pretraining.data.formats import ExampleFormat
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.instantiate import build, check_targets, with_current_targets
from pretraining.objectives import CausalLM, PretrainingObjective, build_objective
from pretraining.quiet import set_up_messages
from pretraining.schema import check_schema
from pretraining.settings import EvalSettings


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint, a file or a sharded directory (its shards gathered in this one process),
    without executing code from it (tensors and plain data only), after checking it against its
    sidecar when it has one (checkpoints copied without it still load)."""
    path = existing_checkpoint(path)
    if sidecar_path(path.resolve()).is_file():
        verify(path)
    checkpoint = load_sharded(path) if path.is_dir() else load_weights_only(path)
    written = lineage_of(checkpoint, path).get("format")
    if written not in READABLE_LINEAGE_FORMATS:
        raise ConfigError(
            f"{path} has lineage format {written}, this code reads {READABLE_LINEAGE_FORMATS}: evaluate it with "
            f"the code revision that wrote it ({checkpoint['lineage'].get('code', {}).get('commit')})"
        )
    return checkpoint


def existing_checkpoint(path: str | Path) -> Path:
    """`path`, refused with the place runs keep their checkpoints if nothing is there."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} not found; runs keep them in logs/train/runs/<run>/checkpoints/")
    return path


def lineage_of(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    """The lineage record of a loaded checkpoint, refused if it has none."""
    if "lineage" not in checkpoint:
        raise ConfigError(f"{path} has no lineage record: it was not written by `pretrain`, so its config is unknown")
    return checkpoint["lineage"]


def stored_config(checkpoint: dict[str, Any], source: str, trusted_targets: Sequence[str] = ()) -> DictConfig:
    """The config a checkpoint was trained with, read from `source`, refused if it names any class not
    trusted in its tokenizer, data or model groups (the ones rebuilt from it)."""
    run = OmegaConf.create(with_current_targets(checkpoint["lineage"]["config"]))
    for group in ("tokenizer", "data", "model"):
        check_targets(run.get(group), group, trusted_targets, f"the config stored in {source}")
    return run


def stored_tokenizer(checkpoint: dict[str, Any], run: DictConfig, tokenizer_path: str | None, option: str) -> Tokenizer:
    """The tokenizer a checkpoint was trained with (its file at `tokenizer_path` if given), refused unless
    its fingerprint is the checkpoint's; `option` is how the caller passes another path."""
    if tokenizer_path and "path" not in run.tokenizer:
        raise ConfigError(f"this checkpoint's tokenizer ({run.tokenizer._target_}) reads no file: leave out {option}")
    node = cast(DictConfig, OmegaConf.merge(run.tokenizer, {"path": tokenizer_path} if tokenizer_path else {}))
    if "path" in node and not Path(node.path).is_file():
        raise MissingFileError(
            f"the tokenizer this checkpoint was trained with, {node.path}, is not there: restore it, or pass "
            f"where it is now with {option}"
        )
    tokenizer: Tokenizer = build(node)
    expected = checkpoint["lineage"]["tokenizer_fingerprint"]
    if tokenizer.fingerprint != expected:
        raise ConfigError(
            f"the tokenizer {node.get('path', node._target_)} (fingerprint {tokenizer.fingerprint}) is not the one "
            f"this checkpoint was trained with ({expected}); restore that tokenizer file"
        )
    return tokenizer


def stored_model(
    checkpoint: dict[str, Any],
    source: str,
    tokenizer_path: str | None = None,
    trusted_targets: Sequence[str] = (),
    tokenizer_option: str = "tokenizer_path=...",
) -> tuple[PretrainingObjective, DictConfig, ExampleFormat[Any]]:
    """The objective of a loaded checkpoint with its weights, its stored config, and its example format
    (with the tokenizer), rebuilt from `source` without reading any data: built only if its config names
    nothing but trusted classes. `tokenizer_option` is how the caller passes a tokenizer that moved."""
    run = stored_config(checkpoint, source, trusted_targets)
    tokenizer = stored_tokenizer(checkpoint, run, tokenizer_path, tokenizer_option)
    examples = build(run.data.format)(tokenizer)
    model = build_objective(run.model, examples)
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:  # missing, unexpected or misshapen weights
        commit = checkpoint["lineage"].get("code", {}).get("commit")
        first = (str(error).splitlines()[1:] or [str(error)])[0].strip()[:300]  # after "Error(s) in loading ...:"
        raise CheckpointError(
            f"the weights in {source} do not fit the model its config builds ({first}): use the code revision "
            f"that wrote it ({commit})"
        ) from None
    return model, run, examples


def build_from_checkpoint(
    checkpoint: dict[str, Any],
    source: str,
    data_overrides: dict[str, Any],
    tokenizer_path: str | None = None,
    trusted_targets: Sequence[str] = (),
) -> tuple[PretrainingObjective, Any]:
    """The objective (with the checkpoint's weights) and the DataModule the checkpoint was trained with."""
    model, run, examples = stored_model(checkpoint, source, tokenizer_path, trusted_targets)
    return model, build(run.data, tokenizer=examples.tokenizer, **data_overrides)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Validation metrics of `cfg.ckpt_path` and a sample, also written to metrics.json."""
    check_schema(cfg, EvalSettings, "configs/eval.yaml")
    set_up_messages(cfg.quiet)
    checkpoint = load_checkpoint(cfg.ckpt_path)
    overrides = {key: value for key, value in (("dir", cfg.data_dir), ("val_size", cfg.val_size)) if value is not None}
    overrides["trust_pipe_commands"] = cfg.trust_pipe_commands  # the command line's word, never the stored one
    trusted = list(cfg.trusted_targets)
    model, datamodule = build_from_checkpoint(checkpoint, str(cfg.ckpt_path), overrides, cfg.tokenizer_path, trusted)
    trainer = Trainer(accelerator=cfg.accelerator, devices=1, logger=False, enable_checkpointing=False)
    (metrics,) = trainer.validate(model, datamodule=datamodule, verbose=not cfg.quiet)
    result: dict[str, Any] = {"checkpoint": str(cfg.ckpt_path), "step": checkpoint["global_step"], **metrics}
    if cfg.prompt and isinstance(model, CausalLM):
        torch.manual_seed(cfg.seed)
        result["sample"] = model.complete(
            datamodule.tokenizer, cfg.prompt, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k
        )
    if datamodule.manifest.version != checkpoint["lineage"]["data_version"]:
        result["note"] = "evaluated on a different data version than the checkpoint was trained on"
    out = Path(cfg.paths.output_dir) / "metrics.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key}: {value}" if key != "sample" else f"sample:\n{'-' * 60}\n{value}\n{'-' * 60}")
    return result
