"""Where a run continues from, and whether a checkpoint fits the run continuing it. A run lives in a directory named
by the run (`logs/<task>/runs/<run_name>/`), so the same command again continues from its newest verified checkpoint
(`resume=auto`). `ckpt_path=...` starts from that checkpoint until the run has its own, so a requeued job does not go
back. `resume=never` moves earlier outputs aside every time: keep it out of a job script a scheduler requeues. Data
version, tokenizer, topology and parameter shapes must match unless `resume_allow` names the deliberate change."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple, get_args

from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from pretraining.checkpoint import LINEAGE_FORMAT, newest_verified, verify
from pretraining.errors import CheckpointError, ConfigError, MissingFileError
from pretraining.models.parametrization import check_same_parametrization
from pretraining.run_lock import is_job_file
from pretraining.settings import Change, ResumeMode

RESUME_MODES = get_args(ResumeMode)
# What a resume compares (lineage key, fix); `resume_allow` may accept each. Parameter shapes never are.
FIT_CHECKS: dict[Change, tuple[str, str]] = {
    "data": ("data_version", "point data.dir (or data.sources) at the shards it was trained on"),
    "tokenizer": ("tokenizer_fingerprint", "use the tokenizer it was trained with"),
    "topology": (
        "topology",
        "use the same data.global_batch_size, data.streams, data.num_workers, accumulation (devices x "
        "data.micro_batch_size), data.shuffle_buffer, sequence lengths, sample fields and seed",
    ),
    "mixture": ("mixture", "use the data.sources weights, max_epochs, exhausted and fields it was trained with"),
}
# What `resume_allow=[...]` does for each change it accepts.
ALLOWED_MEANS = {
    "data": "the new data starts from its beginning (in a mixture, each source that changed)",
    "tokenizer": "the model reads the new tokenizer's ids",
    "topology": "the data position resumes approximately",
    "mixture": "every source continues where it was, under the new settings from this step on",
}
ALLOWABLE_CHANGES = get_args(Change)


class Resume(NamedTuple):
    """A checkpoint to continue from, and its verified sidecar."""

    path: Path
    sidecar: dict[str, Any]


def checkpoint_to_resume(resume: str, ckpt_path: str | None, checkpoints: Path) -> Resume | None:
    """The checkpoint to continue from, or None to start fresh (always with resume=never: the caller then runs
    `start_over` once the fresh start passed its checks)."""
    if resume not in RESUME_MODES:
        raise ConfigError(f"resume={resume!r}: use one of {', '.join(RESUME_MODES)} (or set ckpt_path=<file>)")
    if resume == "never":
        return None
    found = newest_verified(checkpoints)
    if found:
        rank_zero_info(f"resuming from {found[0]} (step {found[1]['step']}); pass resume=never to start over")
        return Resume(*found)
    if ckpt_path:
        path = Path(ckpt_path).resolve()
        if not path.exists():
            raise MissingFileError(f"ckpt_path={ckpt_path} not found; runs keep checkpoints in <run>/checkpoints/")
        return Resume(path, verify(path))
    return None


@rank_zero_only
def start_over(run_dir: Path) -> None:
    """Move an earlier run's outputs in `run_dir` aside (this job's `.hydra/` already overwrote the earlier one).
    This job's lock stays (moved, a second job could take a new one), and so does its status record."""
    earlier = [p for p in run_dir.iterdir() if not is_job_file(p)] if run_dir.is_dir() else []
    earlier = [p for p in earlier if not p.name.startswith("replaced-")]
    if not earlier:
        return
    aside = run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**9:09d}"
    aside.mkdir()
    for path in earlier:
        shutil.move(str(path), aside / path.name)
    rank_zero_info(f"resume=never: moved the earlier run's outputs to {aside}")


def check_fits(
    checkpoint: Path,
    sidecar: dict[str, Any],
    expected: dict[str, Any],
    parameters: dict[str, list[int]],
    allow: list[str],
) -> None:
    """Refuse, before any work, a checkpoint trained on other data, tokenizer, topology, parametrization or model
    shape."""
    unknown = sorted(set(allow) - set(ALLOWABLE_CHANGES))
    if unknown:
        raise ConfigError(
            f"resume_allow={allow}: {unknown} unknown; the allowable changes are {list(ALLOWABLE_CHANGES)}"
        )
    lineage = sidecar["lineage"]
    if lineage.get("format") != LINEAGE_FORMAT:
        raise CheckpointError(
            f"{checkpoint} was written by another version of this code (lineage format {lineage.get('format')}, "
            f"this code writes {LINEAGE_FORMAT}), whose data position this code cannot restore: continue it with the "
            f"code revision that wrote it ({(lineage.get('code') or {}).get('commit')}), or start a separate run "
            f"(run_name=<new name> or resume=never)"
        )
    changed = [what for what, (key, _) in FIT_CHECKS.items() if what not in allow and lineage.get(key) != expected[key]]
    if changed:
        problems = []
        for what in changed:
            key, fix = FIT_CHECKS[what]
            problems.append(f"{what}: the checkpoint has {lineage.get(key)}, this run has {expected[key]} ({fix})")
        raise CheckpointError(
            f"{checkpoint} does not fit this run:\n  " + "\n  ".join(problems) + f"\nTo change this deliberately, pass "
            f"resume_allow=[{','.join(changed)}] ({'; '.join(f'{what}: {ALLOWED_MEANS[what]}' for what in changed)}); "
            f"to start a separate run, pass run_name=<new name> or resume=never"
        )
    saved = sidecar["parameters"]
    if saved != parameters:
        differing = sorted(name for name in saved.keys() | parameters.keys() if saved.get(name) != parameters.get(name))
        name = differing[0]
        positions = "position_embedding.weight" in differing  # one side has rotary positions
        hint = " (model.backbone.positions: learned positions have a table, rotary ones none)" if positions else ""
        raise CheckpointError(
            f"{checkpoint} holds another model: parameter {name} has shape {saved.get(name)} there and "
            f"{parameters.get(name)} here ({len(differing)} parameters differ); resume with the model config it was "
            f"trained with{hint}, or start a separate run (run_name=<new name> or resume=never)"
        )
    check_same_parametrization(lineage.get("parametrization"), expected["parametrization"])  # same shapes, other rules
