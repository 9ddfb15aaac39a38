"""The teacher of a distillation run (`model.teacher`): found, verified, checked and attached.

A reference is a checkpoint path or a registry reference (an alias or a version of `paths.registry_dir`).
The checkpoint must verify against its sidecar, must not be tainted in the registry (unless
`allow_tainted=true`), must have been trained with the objective the student learns and the same
tokenizer, and must have positions for the student's examples. A resumed run takes the teacher it
started with, as its lineage records it, even if the alias has moved since: the same run must see the
same teacher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig

from pretraining.checkpoint import CheckpointError, sidecar_digest, verify
from pretraining.data.formats import ExampleFormat
from pretraining.errors import ConfigError
from pretraining.objectives import Distillation, FrozenTeacher, PretrainingObjective
from pretraining.registry.versions import Registry, check_not_tainted, file_status
from pretraining.resume import Resume
from pretraining.stored import load_checkpoint, stored_config, stored_objective


def attach_teacher(
    model: PretrainingObjective, cfg: DictConfig, examples: ExampleFormat[Any], resume: Resume | None
) -> dict[str, Any] | None:
    """Load and attach the teacher of a `Distillation` objective; its record for the lineage (None for
    any other objective)."""
    if not isinstance(model, Distillation):
        return None
    given = f"model.teacher={model.teacher_reference}"
    registry = Registry(cfg.paths.registry_dir)
    recorded = resume.sidecar.get("lineage", {}).get("teacher") if resume else None
    if recorded:
        path, digest = recorded_teacher(recorded, model.teacher_reference)
    else:
        path, digest = named_teacher(model.teacher_reference, registry, given)
    if not cfg.allow_tainted:
        check_not_tainted(registry, digest, f"{given} ({path})", "a teacher", "allow_tainted=true")
    checkpoint = load_checkpoint(path)
    lineage = checkpoint["lineage"]
    if lineage["tokenizer_fingerprint"] != examples.tokenizer.fingerprint:
        raise ConfigError(
            f"{given} was trained with another tokenizer (fingerprint {lineage['tokenizer_fingerprint']}, the run's "
            f"is {examples.tokenizer.fingerprint}): a student learns the teacher's distribution over the same tokens; "
            "pass the teacher's tokenizer (its run's `tokenizer=` settings)"
        )
    teacher, _ = stored_objective(
        checkpoint, stored_config(checkpoint, given, cfg.trusted_targets), given, examples.tokenizer
    )
    check_teacher_fits(model, teacher, examples, given)
    version = registry.state().by_digest(digest)
    record = {
        "reference": model.teacher_reference,
        "path": str(path.resolve()),
        "digest": digest,
        "registry_version": version.number if version else None,
        "step": checkpoint["global_step"],
    }
    model.attach_teacher(FrozenTeacher(teacher))
    parameters = sum(parameter.numel() for parameter in teacher.parameters()) / 1e6
    named = f" (registry {version.name})" if version else ""
    rank_zero_info(
        f"teacher: {type(teacher).__name__}, {parameters:.2f}M parameters, {path}{named}, step {record['step']}"
    )
    return record


def named_teacher(reference: str, registry: Registry, given: str) -> tuple[Path, str]:
    """The checkpoint a teacher reference names (a path, else a registry alias or version) and its digest,
    verified; a registered one must still be the checkpoint that was registered."""
    if Path(reference).exists():
        path = Path(reference)
        return path, sidecar_digest(verify(path))
    try:
        version = registry.resolve(reference)
    except ConfigError as error:
        raise ConfigError(f"{given}: {error}") from None
    path = Path(version.path)
    status = file_status(version)
    if status != "ok":
        raise CheckpointError(
            f"{given} is registry {version.name}, whose file is {status}: restore it, or name another"
        )
    return path, version.digest


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
    student: Distillation, teacher: PretrainingObjective, examples: ExampleFormat[Any], given: str
) -> None:
    if not isinstance(teacher, student.teacher_kind):
        raise ConfigError(
            f"{given} is a {type(teacher).__name__} model, and a {type(student).__name__} student learns from a "
            f"{student.teacher_kind.__name__} teacher: choose a teacher trained with that objective"
        )
    longest = max(examples.lengths.values())
    if longest > teacher.backbone.max_seq_len:
        raise ConfigError(
            f"the student's examples are {longest} tokens long and the teacher {given} has "
            f"{teacher.backbone.max_seq_len} positions: lower data.format's lengths to fit the teacher"
        )
