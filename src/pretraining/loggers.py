"""Loggers: W&B that goes offline by itself when there are no credentials and keeps one run
across restarts, and a CSV logger that continues its file when the run resumes."""

from __future__ import annotations

import csv
import io
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from pretraining.checkpoint import read_sidecar, sidecar_path
from pretraining.errors import ConfigError
from pretraining.files import write_atomically
from pretraining.registry.mirror import wandb_credentials_available


class WandbRunLogger(WandbLogger):
    """Lightning's `WandbLogger`, offline unless credentials exist (`offline=None`), and continuing one
    W&B run across restarts: without an `id`, the run directory's own (`wandb_run_id`, made on the
    first start) is used. With `checkpoint_artifacts`, each checkpoint `StepCheckpoint` saves becomes
    a version of the artifact `checkpoints-<run id>` (aliases `latest` and `step-N`, the sidecar's
    step and lineage as metadata): `reference` records its path and checksums (nothing copied; for a
    filesystem every reader shares), `upload` copies it into the run (uploaded by `wandb sync` when
    offline). Lightning's `log_model` is not used: it follows `ModelCheckpoint` only, and not offline."""

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
            # No banners: an online run still prints its URL; offline, W&B only writes files (silent) and
            # the run's report has the sync command. Settings given in the config win.
            kwargs["settings"] = {"quiet": True, "silent": offline, **kwargs.get("settings", {})}
        super().__init__(save_dir=save_dir, offline=offline, id=id, resume="allow", **kwargs)
        self._wandb_init.pop("anonymous", None)  # Lightning passes it always, and W&B warns that it does nothing
        self.checkpoint_artifacts = checkpoint_artifacts

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


CHECKPOINT_ARTIFACTS = (None, "reference", "upload")


def run_id(run_dir: Path) -> str:
    """The W&B run id kept in `run_dir/wandb_run_id`, created (atomically) on first use."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, secrets.token_hex(4).encode())
    return path.read_text().strip()


def wandb_sync_hint(loggers: list[Logger]) -> str | None:
    """The command that uploads an offline W&B run, if one was logged."""
    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._offline and logger._experiment is not None:
            return f"wandb sync {Path(logger.experiment.dir).parent}"
    return None


class ContinuedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing metrics file is continued, not deleted, and
    that the rewrite a new metric's column needs replaces the file atomically (Lightning's rewrites it
    in place: a crash then would lose the rows logged so far)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = next(csv.reader(file), [])

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        path = Path(self.metrics_file_path)
        with path.open(newline="") as file:
            rows = list(csv.DictReader(file))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(path, text.getvalue().encode())


class ResumableCSVLogger(CSVLogger):
    """A `CSVLogger` whose `metrics.csv` keeps the rows of the run before a resume (Lightning's
    deletes them). Steps replayed after a crash appear twice; the later row is the one that counts."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if not isinstance(self._experiment, ContinuedExperimentWriter):
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedExperimentWriter(log_dir=self.log_dir)
        return self._experiment
