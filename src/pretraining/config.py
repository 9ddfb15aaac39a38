"""Where configs live, their resolvers, the check of a run directory's names, and credential redaction. A check of
one value lives where it enters; those across groups are `pretraining.run.check_config`."""

from __future__ import annotations

import copy
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretraining.errors import ConfigError
from pretraining.files import regular_file
from pretraining.run_lock import CONFIG_COPIES

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
    named = what_runs(overrides)
    if not named:
        return experiment
    return f"{experiment}-{hashlib.sha256(' '.join(named).encode()).hexdigest()[:8]}"


def what_runs(overrides: Iterable[str]) -> list[str]:
    """The `overrides` that change what runs (not how), sorted: they name a run, and tell two jobs' runs apart."""
    return sorted(o for o in overrides if o.split("=")[0].lstrip("+~") not in RUN_CONTROL_KEYS)


def job_output_dir() -> str:
    """The job's directory (`paths.output_dir`): Hydra's `runtime.output_dir`, set when a job runs. Composed for
    `--cfg job`, always as a single run, where none is set: the directory that run gets, `hydra.run.dir`."""
    hydra = HydraConfig.get()
    if OmegaConf.is_missing(hydra.runtime, "output_dir"):
        return os.path.abspath(hydra.run.dir)
    return str(hydra.runtime.output_dir)


# One suffix per process: two evaluations started in the same second get different directories.
_RUN_SUFFIX = secrets.token_hex(3)
OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT), replace=True)
OmegaConf.register_new_resolver("run_suffix", lambda: _RUN_SUFFIX, replace=True)
OmegaConf.register_new_resolver("default_run_name", default_run_name, replace=True)
OmegaConf.register_new_resolver("job_output_dir", job_output_dir, replace=True)
# A multirun's name from the sweep's overrides (configs/hydra/default.yaml). Cached: Hydra copies the sweep's resolver
# cache into each job, whose overrides are its own (`seed=1`), so all jobs agree on the sweep directory.
OmegaConf.register_new_resolver("sweep_name", run_name, use_cache=True, replace=True)


# Keys naming one directory: logs/<task_name>/runs/<run_name> (configs/hydra/default.yaml), a multirun's job
# <hydra.sweep.dir>/<hydra.sweep.subdir>; each with where its directory is, for the message.
DIRECTORY_NAME_KEYS = ("task_name", "run_name")
WHERE = {
    "task_name": "a run's directory is logs/<task_name>/runs/<run_name>",
    "run_name": "a run's directory is logs/<task_name>/runs/<run_name>",
    "hydra.sweep.subdir": "a multirun's job directory is <hydra.sweep.dir>/<hydra.sweep.subdir>",
}
LONGEST_NAME = 255  # bytes of one file name where the file system does not say (most do: ext4, XFS, APFS)


def check_directory_names(config: DictConfig) -> None:
    """Refuse a `task_name` or `run_name` that is not one directory's name (`run_name=../../x` escapes the runs), or
    is longer than a file name may be under `paths.log_dir`."""
    longest = longest_name(Path(str(OmegaConf.select(config, "paths.log_dir", default="."))))
    for key in DIRECTORY_NAME_KEYS:
        room = longest - len(".log") if key == "task_name" else longest  # the run's log file is <task_name>.log
        check_directory_name(key, str(OmegaConf.select(config, key)), room)


def check_directory_name(key: str, name: str, longest: int) -> None:
    if name in {"", ".", ".."} or any(separator and separator in name for separator in (os.sep, os.altsep)):
        raise ConfigError(
            f"{key}={name!r}: {WHERE[key]}, so {key} must name one directory (no '/', not '.' or '..'): "
            f"pass {key}=<name>"
        )
    if len(os.fsencode(name)) > longest:
        raise ConfigError(
            f"{key}={name[:24] + '...'!r} is {len(os.fsencode(name))} bytes long, and may be {longest} bytes at "
            f"most on this file system: pass a shorter {key}=<name>"
        )


def longest_name(directory: Path) -> int:
    """The longest file name, in bytes, on the file system of `directory` (or of its nearest existing parent)."""
    existing = next((path for path in (directory, *directory.resolve().parents) if path.is_dir()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # not said here, or no pathconf (Windows)
        return LONGEST_NAME


def check_sweep_subdir(config: DictConfig) -> None:
    """Refuse a `hydra.sweep.subdir` that is not one directory's name, as the first job would resolve it: each job
    of a multirun writes its own directory inside the sweep's (`../../../x` would escape it)."""
    job = copy.deepcopy(config)
    OmegaConf.set_readonly(job, False)
    job.hydra.job.num, job.hydra.job.id = 0, "0"  # set by the launcher for each job
    HydraConfig.instance().set_config(job)
    try:
        subdir = str(job.hydra.sweep.subdir)
    except OmegaConfBaseException:  # only a job resolves it: checked at the job's start (check_job_directory)
        return
    check_directory_name("hydra.sweep.subdir", subdir, longest_name(Path(str(job.hydra.sweep.dir))))


def check_job_directory(config: DictConfig) -> None:
    """Refuse a multirun's job whose directory is not one directory inside the sweep's, or holds the run of another
    job: one whose recorded overrides (`.hydra/overrides.yaml`) differ from this job's in what runs. The same job of
    the same sweep run again (same overrides, whatever its number) continues its run; another would resume that run
    and report its result as its own."""
    job_dir = Path(config.hydra.runtime.output_dir)
    check_directory_name("hydra.sweep.subdir", str(config.hydra.sweep.subdir), longest_name(job_dir))
    recorded = recorded_overrides(job_dir)
    mine = what_runs(config.hydra.overrides.task)
    if recorded is None or what_runs(recorded) == mine:
        return
    theirs = what_runs(recorded)
    raise ConfigError(
        f"hydra.sweep.subdir={config.hydra.sweep.subdir}: this job ({differences(mine, theirs)}) would write "
        f"{job_dir}, which holds the run of another job ({differences(theirs, mine)}): give each job its own "
        "directory (the default, hydra.sweep.subdir=${hydra.job.num})"
    )


def differences(overrides: list[str], others: list[str]) -> str:
    """The `overrides` that `others` lacks, in words."""
    return " ".join(override for override in overrides if override not in others) or "no other overrides"


def recorded_overrides(job_dir: Path) -> list[str] | None:
    """The overrides a job recorded in `job_dir` (`pretraining.job_status.save_job_config`), None if none did."""
    path = job_dir / CONFIG_COPIES / "overrides.yaml"
    fix = f"remove {path}, or give this job a directory of its own (hydra.sweep.subdir)"
    if not regular_file(path, "the overrides recorded by a job,", fix).is_file():
        return None
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(path))
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException):
        overrides = None
    if not isinstance(overrides, list):
        raise ConfigError(f"{path} is not a list of overrides, so its job cannot be told from this one: {fix}")
    return [str(override) for override in overrides]


SUBDIR_FIX = "hydra.sweep.subdir=<a directory name> (the default: ${hydra.job.num})"


class CheckDirectoryNames(Callback):
    """The directory names' checks before Hydra makes any directory of a run or a sweep, and each multirun job's
    `check_job_directory` before it records itself there (configs/hydra/default.yaml: before the job-status
    callback)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unless(config, check_directory_names, "task_name or run_name", "run_name=<name>")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_unless(config, check_directory_names, "task_name or run_name", "run_name=<name>")
        refuse_unless(config, check_sweep_subdir, "hydra.sweep.subdir", SUBDIR_FIX)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            refuse_unless(config, check_job_directory, "hydra.sweep.subdir", SUBDIR_FIX)


def refuse_unless(config: DictConfig, check: Callable[[DictConfig], None], keys: str, fix: str) -> None:
    """Run `check` on `config`, exiting with its one line if it refuses. Hydra reports a callback's exception as a
    warning and carries on; a name that cannot be checked (resolved, or its directory read) is refused, not guessed
    at, naming the `keys` checked and the `fix`."""
    hydra = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(copy.deepcopy(config))  # as for the job: the names may read it
        check(config)
    except ConfigError as error:  # a MissingFileError is one
        sys.exit(str(error))
    except Exception as error:
        sys.exit(f"{keys} cannot be checked ({type(error).__name__}: {error}): pass {fix}")
    finally:
        HydraConfig.instance().cfg = hydra


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
