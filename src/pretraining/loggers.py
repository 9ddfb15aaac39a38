"""Loggers: W&B that goes offline by itself when there are no credentials."""

from __future__ import annotations

import netrc
import os
import secrets
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only


def wandb_credentials_available() -> bool:
    """True if an API key is in the environment or in ~/.netrc (as `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_logger(save_dir: str, offline: bool | None = None, id: str | None = None, **kwargs: Any) -> WandbLogger:
    """A `WandbLogger`; `offline=None` means offline unless credentials exist. Without an `id`, the
    run directory's own (`wandb_run_id`, made on the first start) is used, so a resumed run
    continues the same W&B run, online or offline."""
    if offline is None:
        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_available()
    if id is None and getattr(rank_zero_only, "rank", 0) == 0:  # only rank zero logs to W&B
        id = run_id(Path(save_dir))
    return WandbLogger(save_dir=save_dir, offline=offline, id=id, resume="allow", **kwargs)


def run_id(run_dir: Path) -> str:
    """The W&B run id kept in `run_dir/wandb_run_id`, created (atomically) on first use."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(secrets.token_hex(4))
        os.replace(temporary, path)
    return path.read_text().strip()


def wandb_sync_hint(loggers: list[Logger]) -> str | None:
    """The command that uploads an offline W&B run, if one was logged."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._offline and logger._experiment is not None:
            return f"wandb sync {Path(logger.experiment.dir).parent}"
    return None
