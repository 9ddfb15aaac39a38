"""The teacher of a distillation run (`model.teacher`): found, verified, checked and loaded.

A reference is a checkpoint path or, where the registry extra is installed, a registry reference (an
alias or a version of `model.registry_dir`). The checkpoint must verify against its sidecar, must not be
tainted in the registry (unless `allow_tainted=true`), must have been trained with the objective
the student learns and the same tokenizer, and must have positions for the student's examples. A resumed
run takes the teacher it started with, as its lineage records it, even if the alias has moved since: the
same run must see the same teacher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretraining.checkpoint import CheckpointError, sidecar_digest, verify
from pretraining.data.formats import ExampleFormat
from pretraining.errors import ConfigError
from pretraining.objectives.base import PretrainingObjective
from pretraining.stored import load_checkpoint, stored_config, stored_objective

try:  # the registry extra, where this fork keeps it: aliases name teachers, and tainted ones are refused
    from pretraining.extras.registry import versions as registry
except ModuleNotFoundError:
    registry = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TeacherChoice:
    """Which teacher a student names (`model.teacher`), and how it is looked up and checked."""

    reference: str  # a checkpoint path, or a registry alias or version
    registry_dir: str | None = None
    allow_tainted: bool = False
    trusted_targets: Sequence[str] = field(default_factory=list)  # modules the teacher's stored config may build


def load_teacher(
    choice: TeacherChoice,
    kind: type[PretrainingObjective],
    examples: ExampleFormat[Any],
    recorded: dict[str, Any] | None,
) -> tuple[PretrainingObjective, dict[str, Any]]:
    """The teacher of objective `kind` that a student of `examples` learns from (the `recorded` one of a
    resumed run, else the one `choice` names), with its record for the lineage: reference, path, digest,
    registry version and step."""
    reference = choice.reference
    given = f"model.teacher={reference}"
    path, digest = recorded_teacher(recorded, reference) if recorded else named_teacher(choice, given)
    version = None
    if registry is not None and choice.registry_dir is not None:
        ledger = registry.Registry(choice.registry_dir)
        if not choice.allow_tainted:
            registry.check_not_tainted(ledger, digest, f"{given} ({path})", "a teacher", "allow_tainted=true")
        version = ledger.state().by_digest(digest)
    checkpoint = load_checkpoint(path)
    lineage = checkpoint["lineage"]
    if lineage["tokenizer_fingerprint"] != examples.tokenizer.fingerprint:
        raise ConfigError(
            f"{given} was trained with another tokenizer (fingerprint {lineage['tokenizer_fingerprint']}, the run's "
            f"is {examples.tokenizer.fingerprint}): a student learns the teacher's distribution over the same tokens; "
            "pass the teacher's tokenizer (its run's `tokenizer=` settings)"
        )
    config = stored_config(checkpoint, given, choice.trusted_targets)
    teacher, _ = stored_objective(checkpoint, config, given, examples.tokenizer)
    check_teacher_fits(kind, teacher, examples, given)
    record = {
        "reference": reference,
        "path": str(path.resolve()),
        "digest": digest,
        "registry_version": version.number if version else None,
        "step": checkpoint["global_step"],
    }
    registered = f", registry v{version.number}" if version else ""
    record["summary"] = f"{record['path']} (step {record['step']}{registered}; given as {reference})"
    return teacher, record


def named_teacher(choice: TeacherChoice, given: str) -> tuple[Path, str]:
    """The checkpoint a teacher reference names (a path, else a registry alias or version) and its digest,
    verified; a registered one must still be the checkpoint that was registered."""
    if Path(choice.reference).exists():
        path = Path(choice.reference)
        return path, sidecar_digest(verify(path))
    if registry is None or choice.registry_dir is None:
        raise ConfigError(f"{given}: no such checkpoint; name a checkpoint file (or the directory of a sharded one)")
    try:
        version = registry.Registry(choice.registry_dir).resolve(choice.reference)
    except ConfigError as error:
        raise ConfigError(f"{given}: {error}") from None
    status = registry.file_status(version)
    if status != "ok":
        raise CheckpointError(
            f"{given} is registry {version.name}, whose file is {status}: restore it, or name another"
        )
    return Path(version.path), version.digest


def recorded_teacher(recorded: dict[str, Any], reference: str) -> tuple[Path, str]:
    """The teacher a resumed run was distilled from, as its lineage records it: the same reference must name
    it (an alias may have moved since: the run keeps its teacher), and the file must be unchanged."""
    path = Path(recorded["path"])
    same = reference == recorded["reference"] or (Path(reference).exists() and Path(reference).resolve() == path)
    if not same:
        raise ConfigError(
            f"model.teacher={reference}: this run was distilled from {path} (model.teacher={recorded['reference']}): "
            f"pass that to continue it, or start a new run (resume=never, or another run_name) to distil from another"
        )
    if not path.exists():
        raise CheckpointError(
            f"this run was distilled from the teacher {path}, which is not there any more: restore it (its SHA-256 "
            f"is {recorded['digest']}), or start a new run (resume=never, or another run_name)"
        )
    digest = sidecar_digest(verify(path))
    if digest != recorded["digest"]:
        raise CheckpointError(
            f"this run was distilled from the teacher {path} (digest {recorded['digest'][:12]}), and the file there "
            "is now another checkpoint: restore it, or start a new run (resume=never, or another run_name)"
        )
    return path, digest


def check_teacher_fits(
    kind: type[PretrainingObjective], teacher: PretrainingObjective, examples: ExampleFormat[Any], given: str
) -> None:
    if not isinstance(teacher, kind):
        raise ConfigError(
            f"{given} is a {type(teacher).__name__} model, and the student learns from a {kind.__name__} teacher: "
            "choose a teacher trained with that objective"
        )
    longest = max(examples.lengths.values())
    if longest > teacher.backbone.max_seq_len:
        raise ConfigError(
            f"the student's examples are {longest} tokens long and the teacher {given} has "
            f"{teacher.backbone.max_seq_len} positions: lower data.format's lengths to fit the teacher"
        )
