"""Loggers: W&B that goes offline by itself when there are no credentials."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger


def wandb_credentials_available() -> bool:
    """True if an API key is in the environment or in ~/.netrc (as `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_logger(offline: bool | None = None, **kwargs: Any) -> WandbLogger:
    """A `WandbLogger`; `offline=None` means offline unless credentials exist."""
    if offline is None:
        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_available()
    return WandbLogger(offline=offline, **kwargs)


def wandb_sync_hint(loggers: list[Logger]) -> str | None:
    """The command that uploads an offline W&B run, if one was logged."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._offline and logger._experiment is not None:
            return f"wandb sync {Path(logger.experiment.dir).parent}"
    return None
