"""Where configs live, their resolvers, the check of a run directory's names, and credential redaction. A check of
one value lives where it enters; those across groups are `pretraining.run.check_config`."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pretraining.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = PROJECT_ROOT / "configs"
REGISTRY_DIR = PROJECT_ROOT / "logs" / "registry"  # the default paths.registry_dir, for the commands without Hydra

# Overrides that say how to run, not what: they do not change the run's name.
RUN_CONTROL_KEYS = {
    "experiment",
    "run_name",
    "resume",
    "ckpt_path",
    "resume_allow",
    "allow_tainted",
    "trusted_targets",
    "quiet",
}


def default_run_name() -> str:
    """The experiment's name plus a short hash of the other overrides: the same command names (and resumes) the
    same run, a different command another."""
    try:
        hydra = HydraConfig.get()
    except ValueError:  # composed outside a Hydra application (tests, notebooks)
        return "default"
    return run_name(hydra.runtime.choices.get("experiment"), hydra.overrides.task)


def run_name(experiment: str | None, overrides: Iterable[str]) -> str:
    """`experiment`, plus a short hash of the `overrides` that change what runs (not how)."""
    experiment = (experiment or "default").replace("/", "-")  # one directory: configs/experiment/team/x.yaml too
    named = sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in RUN_CONTROL_KEYS)
    if not named:
        return experiment
    return f"{experiment}-{hashlib.sha256(' '.join(named).encode()).hexdigest()[:8]}"


# One suffix per process: two evaluations started in the same second get different directories.
_RUN_SUFFIX = secrets.token_hex(3)
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
OmegaConf.register_new_resolver("run_suffix", lambda: _RUN_SUFFIX, replace=True)
OmegaConf.register_new_resolver("default_run_name", default_run_name, replace=True)
# A multirun's name from the sweep's overrides (configs/hydra/default.yaml). Cached: Hydra copies the sweep's resolver
# cache into each job, whose overrides are its own (`seed=1`), so all jobs agree on the sweep directory.
OmegaConf.register_new_resolver("sweep_name", run_name, use_cache=True, replace=True)


# Keys naming a directory of their own: logs/<task_name>/runs/<run_name> (configs/hydra/default.yaml).
DIRECTORY_NAME_KEYS = ("task_name", "run_name")


def check_directory_names(config: DictConfig) -> None:
    """Refuse a `task_name` or `run_name` that is not one directory's name (`run_name=../../x` escapes the runs)."""
    for key in DIRECTORY_NAME_KEYS:
        name = str(config[key])
        if name in {"", ".", ".."} or any(separator and separator in name for separator in (os.sep, os.altsep)):
            raise ConfigError(
                f"{key}={name!r}: a run's directory is logs/<task_name>/runs/<run_name>, so {key} must name one "
                f"directory (no '/', not '.' or '..'): pass {key}=<name>"
            )


class CheckDirectoryNames(Callback):
    """`check_directory_names` before Hydra makes any directory of a run or a sweep (configs/hydra/default.yaml)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra reports a callback's exception as a warning and carries on: exit with our one line; a name that
        # cannot be resolved is refused, not guessed at.
        try:
            HydraConfig.instance().set_config(copy.deepcopy(config))  # as for the job: the names may read it
            check_directory_names(config)
        except ConfigError as error:
            sys.exit(str(error))
        except Exception as error:
            sys.exit(f"{' or '.join(DIRECTORY_NAME_KEYS)} cannot be resolved ({error}): pass run_name=<name>")

    on_multirun_start = on_run_start


# Key and environment variable names holding credentials: `api_key`, `HF_TOKEN`, `db_password`; not `max_new_tokens`.
SECRET_NAME = re.compile(r"(^|[_.-])(api_?key|access_?key|secret(_?key)?|token|password|passwd|credentials?)$", re.I)
SHORTEST_SECRET = 8  # shorter environment values ("1", "true") cannot be told apart from settings
REDACTED = "<redacted>"


def redact_secrets(config: Any, environment: Mapping[str, str] | None = None) -> Any:
    """`config` (nested dicts and lists) without credentials, for logging and lineage: the values of keys named like
    secrets, and any environment credential inside a string (`${oc.env:...}`), become `<redacted>`."""
    secret_values = sorted(
        (
            value
            for name, value in (os.environ if environment is None else environment).items()
            if SECRET_NAME.search(name) and len(value) >= SHORTEST_SECRET
        ),
        key=len,
        reverse=True,  # the longest first, so that a secret containing another is redacted whole
    )

    def redact(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {name: redact(item, str(name)) for name, item in value.items()}
        if isinstance(value, list):
            return [redact(item) for item in value]
        if isinstance(value, str):
            if SECRET_NAME.search(key) and value:
                return REDACTED
            for secret in secret_values:
                value = value.replace(secret, REDACTED)
        return value

    return redact(config)
