"""Objects built from config nodes."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


def build(node: DictConfig, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate`, letting our own errors (which name the key and the fix) through unwrapped."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        while isinstance(cause, InstantiationException):
            cause = cause.__cause__
        if isinstance(cause, ValueError | FileNotFoundError):
            raise cause from None
        raise
