"""What a checkpoint stored, rebuilt: its config, its tokenizer and its objective with its weights,
without running code from the file (tensors load weights-only; the config builds only trusted classes).
Evaluation, export and a distillation's teacher all start here."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretraining.checkpoint import (
    READABLE_LINEAGE_FORMATS,
    existing_checkpoint,
    lineage_of,
    load_weights_only,
    sidecar_path,
    verify,
)
from pretraining.checkpoint.sharded import load_sharded
from pretraining.compat import current_config
from pretraining.data.formats import ExampleFormat
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.instantiate import TRUST_OPTION, build, check_targets
from pretraining.objectives.base import PretrainingObjective, build_objective


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


def stored_config(
    checkpoint: dict[str, Any], source: str, trusted_targets: Sequence[str] = (), trust_option: str = TRUST_OPTION
) -> DictConfig:
    """The config a checkpoint was trained with, read from `source`, refused if it names any class not
    trusted in its tokenizer, data or model groups (the ones rebuilt from it); `trust_option` is how the
    caller trusts a module (`pretraining.instantiate.check_targets`)."""
    with rebuilding(checkpoint, source):
        run = OmegaConf.create(current_config(checkpoint["lineage"]["config"]))  # older versions' names
    for group in ("tokenizer", "data", "model"):
        check_targets(run.get(group), group, trusted_targets, f"the config stored in {source}", trust_option)
    return run


@contextmanager
def rebuilding(checkpoint: dict[str, Any], source: str) -> Iterator[None]:
    """Turn a failure to rebuild what the config stored in `source` names (a key no class takes, a value of
    the wrong type, a group missing) into one line naming the file; our own errors already are one."""
    try:
        yield
    except (InstantiationException, OmegaConfBaseException, TypeError, KeyError, AttributeError) as error:
        commit = checkpoint["lineage"].get("code", {}).get("commit")
        raise ConfigError(
            f"the config stored in {source} cannot be rebuilt ({' '.join(str(error).split())[:300]}): it was "
            f"edited, or written by another code revision; use a checkpoint as `pretrain` wrote it, with the code "
            f"revision that wrote it ({commit})"
        ) from error


def stored_tokenizer(
    checkpoint: dict[str, Any], run: DictConfig, source: str, tokenizer_path: str | None, option: str
) -> Tokenizer:
    """The tokenizer a checkpoint (read from `source`) was trained with (its file at `tokenizer_path` if given),
    refused unless its fingerprint is the checkpoint's; `option` is how the caller passes another path."""
    with rebuilding(checkpoint, source):
        if tokenizer_path and "path" not in run.tokenizer:
            raise ConfigError(
                f"this checkpoint's tokenizer ({run.tokenizer._target_}) reads no file: leave out {option}"
            )
        node = cast(DictConfig, OmegaConf.merge(run.tokenizer, {"path": tokenizer_path} if tokenizer_path else {}))
        if "path" in node and not Path(node.path).exists():
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
    trust_option: str = TRUST_OPTION,
) -> tuple[PretrainingObjective, DictConfig, ExampleFormat[Any]]:
    """The objective of a loaded checkpoint with its weights, its stored config, and its example format
    (with the tokenizer), rebuilt from `source` without reading any data: built only if its config names
    nothing but trusted classes. `tokenizer_option` is how the caller passes a tokenizer that moved,
    `trust_option` how it trusts a module."""
    run = stored_config(checkpoint, source, trusted_targets, trust_option)
    tokenizer = stored_tokenizer(checkpoint, run, source, tokenizer_path, tokenizer_option)
    model, examples = stored_objective(checkpoint, run, source, tokenizer)
    return model, run, examples


def stored_objective(
    checkpoint: dict[str, Any], run: DictConfig, source: str, tokenizer: Tokenizer
) -> tuple[PretrainingObjective, ExampleFormat[Any]]:
    """The objective its stored config `run` builds for `tokenizer`, with the checkpoint's weights."""
    with rebuilding(checkpoint, source):
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
    return model, examples
