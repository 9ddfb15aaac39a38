"""Objects built from config nodes, and the rule for configs read from a file. A `pretrain` command's config is the
user's own and may name any class; one read back from a file (a checkpoint's lineage, for `pretrain-eval`) is not:
its writer chose the `_target_`s Hydra calls (`builtins.exec`, `torch.load` with `weights_only=False`). So it may
build only this package's classes, `torch.optim` optimizers and `trusted_targets`; `check_targets` refuses anything
else before a target is imported."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from pretraining.errors import ConfigError, PretrainingError

PACKAGE = "pretraining"
OPTIMIZERS = "torch.optim"
# How a command is told to trust a module (`pretrain-export` passes its own --trusted-targets).
TRUST_OPTION = "trusted_targets=[{module}]"


def build(node: DictConfig, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate`, letting our own errors (which name the key and the fix) through unwrapped."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, PretrainingError | ValueError | FileNotFoundError):
            raise cause from None
        raise


def check_targets(node: Any, key: str, trusted: Sequence[str], source: str, trust_option: str = TRUST_OPTION) -> None:
    """Refuse a config from `source` (a file) whose `_target_`s under `node` (at `key`), nested too, name anything
    but a class of this package, a `torch.optim` optimizer or one under `trusted`; a refusal names `trust_option`."""
    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, dict):
        if "_target_" in node:
            check_target(node["_target_"], f"{key}._target_", trusted, source, trust_option)
        for name, value in node.items():
            check_not_interpolation(name, f"the key {key}.{name}", source)  # Hydra would pass it on as an argument
            check_targets(value, f"{key}.{name}", trusted, source, trust_option)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            check_targets(value, f"{key}[{index}]", trusted, source, trust_option)
    else:
        check_not_interpolation(node, f"{key}={node!r}", source)  # it could bring in a node from anywhere in the file


def check_not_interpolation(text: Any, named: str, source: str) -> None:
    """Refuse a key or value (`named` so) of a config from `source` that holds an interpolation."""
    if isinstance(text, str) and "${" in text:
        raise ConfigError(
            f"{named} in {source} is an interpolation: a run's config is stored resolved, so this file "
            "was edited after it was written; use a checkpoint as `pretrain` wrote it"
        )


def check_target(target: Any, key: str, trusted: Sequence[str], source: str, trust_option: str) -> None:
    """One `_target_`: its name is checked before importing (importing runs a module), then what it resolves to
    (`pretraining.evaluate.torch.load` starts like a class of ours)."""
    if not isinstance(target, str) or not any(within(target, root) for root in (PACKAGE, OPTIMIZERS, *trusted)):
        raise untrusted(target, key, source, trust_option)
    try:
        located = get_object(target)
    except Exception:  # any failure to import it: it cannot be built either
        raise ConfigError(f"{key}={target!r} in {source} cannot be imported: nothing by that name exists") from None
    if not inspect.isclass(located):
        raise ConfigError(
            f"{key}={target!r} in {source} names {type(located).__name__} {located!r}, not a class: a config read "
            "from a file may build only classes"
        )
    if not is_trusted_class(located, trusted):
        raise untrusted(target, key, source, trust_option)


def is_trusted_class(cls: type, trusted: Sequence[str]) -> bool:
    name = f"{cls.__module__}.{cls.__qualname__}"
    optimizer = issubclass(cls, torch.optim.Optimizer) and within(name, OPTIMIZERS)
    return optimizer or any(within(name, root) for root in (PACKAGE, *trusted))


def within(name: str, root: str) -> bool:
    """Whether the dotted `name` is `root` or lies under it (`pretraining.x`, not `pretraining_evil`)."""
    return name == root or name.startswith(f"{root}.")


def untrusted(target: Any, key: str, source: str, trust_option: str) -> ConfigError:
    module = str(target).rpartition(".")[0] or str(target)
    return ConfigError(
        f"{key}={target!r} in {source} is not a class of this package: a config read from a file may build "
        f"only `{PACKAGE}` classes and `{OPTIMIZERS}` optimizers, since whoever wrote the file chose what it "
        f"calls. If you wrote it and trust that code, pass {trust_option.format(module=module)}"
    )
