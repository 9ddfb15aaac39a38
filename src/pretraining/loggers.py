"""Loggers: W&B, offline without credentials and one run across restarts; a CSV a resumed run continues."""

from __future__ import annotations

import csv
import io
import netrc
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from pretraining.checkpoint import read_sidecar, sidecar_path
from pretraining.errors import ConfigError
from pretraining.files import open_to_append, write_atomically
from pretraining.internals import drop_wandb_anonymous

CHECKPOINT_ARTIFACTS = (None, "reference", "upload")


class WandbRunLogger(WandbLogger):
    """`WandbLogger`, offline unless credentials exist (`offline=None`), continuing one W&B run across
    restarts (without an `id`, the run directory's `wandb_run_id`). With `checkpoint_artifacts`, each saved
    checkpoint becomes a version of `checkpoints-<run id>` (aliases `latest`, `step-N`): `reference` records
    its path and checksums (for a shared filesystem), `upload` copies it. Not `log_model`: it follows only
    `ModelCheckpoint`, and not offline."""

    def __init__(
        self,
        save_dir: str,
        offline: bool | None = None,
        id: str | None = None,
        checkpoint_artifacts: str | None = None,
        quiet: bool = True,
        **kwargs: Any,
    ) -> None:
        if checkpoint_artifacts not in CHECKPOINT_ARTIFACTS:
            raise ConfigError(
                f"logger.wandb.checkpoint_artifacts={checkpoint_artifacts!r} must be one of {CHECKPOINT_ARTIFACTS}"
            )
        if offline is None:
            offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_credentials_available()
        if id is None and getattr(rank_zero_only, "rank", 0) == 0:  # only rank zero logs to W&B
            id = run_id(Path(save_dir))
        if quiet and isinstance(kwargs.get("settings", {}), Mapping):
            # No banners (offline, the run's report has the sync command); the config's settings win.
            kwargs["settings"] = {"quiet": True, "silent": offline, **kwargs.get("settings", {})}
        super().__init__(save_dir=save_dir, offline=offline, id=id, resume="allow", **kwargs)
        drop_wandb_anonymous(self)
        self.logs_offline, self.checkpoint_artifacts = offline, checkpoint_artifacts

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        if self.checkpoint_artifacts is None:
            return
        import wandb

        path = Path(checkpoint_callback.last_model_path)
        sidecar = read_sidecar(path)
        artifact = wandb.Artifact(
            f"checkpoints-{self.version}", type="model", metadata={"step": sidecar["step"], **sidecar["lineage"]}
        )
        if self.checkpoint_artifacts == "reference":
            artifact.add_reference(path.resolve().as_uri(), name=path.name)
        elif path.is_dir():
            artifact.add_dir(str(path), name=path.name)
        else:
            artifact.add_file(str(path), name=path.name)
        artifact.add_file(str(sidecar_path(path)))  # so that a download can be verified (`verify`)
        self.experiment.log_artifact(artifact, aliases=["latest", f"step-{sidecar['step']}"])

    def sync_command(self) -> str | None:
        """The command uploading this run's offline W&B files, every restart's (one run id), once there are some."""
        runs = Path(str(self.save_dir)) / "wandb"
        if not self.logs_offline or not any(runs.glob(f"offline-run-*-{self.version}")):
            return None
        return f"wandb sync {runs}/offline-run-*-{self.version}"


def wandb_credentials_available() -> bool:
    """True if an API key is in the environment or in ~/.netrc (as `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def run_id(run_dir: Path) -> str:
    """The W&B run id kept in `run_dir/wandb_run_id`, created (atomically) on first use."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, secrets.token_hex(4).encode())
    return path.read_text().strip()


class ResumableCSVLogger(Logger):
    """`<save_dir>/<name>/metrics.csv`: a row per logging call, a column per metric. A resumed run appends
    (a replayed step's later row counts); a new metric rewrites the file atomically. Not `CSVLogger`: it
    deletes the file on resume and rewrites it in place, so a crash loses every row."""

    def __init__(self, save_dir: str, name: str = "csv", version: str = "") -> None:
        super().__init__()
        self.directory = Path(save_dir) / name / version
        self.path = self.directory / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []

    @property
    def name(self) -> str:
        return self.directory.parent.name

    @property
    def version(self) -> str:
        return self.directory.name

    @property
    def log_dir(self) -> str:
        return str(self.directory)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the config is the run's `.hydra/config.yaml` and every checkpoint's lineage."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.rows.append({**{name: float(value) for name, value in metrics.items()}, "step": step})

    @rank_zero_only
    def save(self) -> None:
        """Write the rows logged since the last save."""
        if not self.rows:
            return
        if not self.columns and self.path.is_file():  # a resumed run: its columns so far
            with self.path.open(newline="") as file:
                self.columns = next(csv.reader(file), [])
        new = sorted({name for row in self.rows for name in row} - set(self.columns))
        if new or not self.path.is_file():
            self.columns = sorted([*self.columns, *new])
            self.rewrite()
        else:
            with open_to_append(self.path, "the CSV logger's file", "remove it; the logger keeps its own") as file:
                csv.DictWriter(file, fieldnames=self.columns).writerows(self.rows)
        self.rows = []

    def rewrite(self) -> None:
        """The file with every row so far under the current columns, replaced atomically."""
        earlier = []
        if self.path.is_file():
            with self.path.open(newline="") as file:
                earlier = list(csv.DictReader(file))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows([*earlier, *self.rows])
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, text.getvalue().encode())

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
