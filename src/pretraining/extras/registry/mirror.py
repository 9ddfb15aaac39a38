"""The registry mirrored to W&B: each version a version of one model artifact that references the
checkpoint (its path and checksums; nothing is uploaded or copied), with the registry's aliases, an
alias `registry-vN` naming the registry's version (W&B numbers its own from v0), and the taint in
its metadata.

With credentials, every change is mirrored as it is made. Without them, the ledger keeps what W&B
has not seen (each version's last mirrored aliases and taint), and `pretrain-registry mirror` catches
up later: online, or with WANDB_MODE=offline into an offline W&B run under the registry directory,
which `wandb sync` uploads. A taint or a rollback reaches W&B as the alias moving to another version;
an alias left pointing nowhere by a taint stays on its old artifact there until it moves.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import wandb

from pretraining.errors import ConfigError
from pretraining.extras.registry.versions import Registry, State, Version, stamp
from pretraining.loggers import wandb_credentials_available

PROJECT, ARTIFACT = "pretraining", "pretraining-models"  # where versions go, unless told otherwise


def online() -> bool:
    return os.environ.get("WANDB_MODE") not in ("offline", "disabled") and wandb_credentials_available()


def mirrored_view(version: Version) -> dict[str, Any]:
    """What W&B shows of a version: compared with the last mirroring to find what it has not seen."""
    return {"aliases": sorted(version.aliases), "taint": version.taint}


def waiting(state: State) -> list[Version]:
    """The versions whose aliases or taint W&B has not seen, and whose files are there to mirror."""
    return [
        version
        for number, version in sorted(state.versions.items())
        if {key: state.mirrored.get(number, {}).get(key) for key in ("aliases", "taint")} != mirrored_view(version)
        and Path(version.path).exists()
    ]


def mirror(registry: Registry, project: str = PROJECT, artifact: str = ARTIFACT) -> tuple[list[Version], str]:
    """Log every waiting version as a version of the model artifact `artifact` in W&B project `project`
    (online with credentials; into an offline run with WANDB_MODE=offline) and record each in the ledger as
    it was sent. Returns the versions mirrored and where to."""
    versions = waiting(registry.state())
    if not versions:
        return [], ""
    if not online() and os.environ.get("WANDB_MODE") != "offline":
        raise ConfigError(
            "no W&B credentials here: `wandb login` (or set WANDB_API_KEY) and mirror again; or WANDB_MODE=offline "
            "to write an offline run that `wandb sync` uploads later"
        )
    mode: Literal["online", "offline"] = "online" if online() else "offline"
    settings = wandb.Settings(quiet=True, silent=True)
    # A run of its own, even inside a training process whose W&B run is active (wandb.init would return that one).
    run = wandb.init(
        project=project, job_type="registry", dir=registry.directory, mode=mode, settings=settings, reinit="create_new"
    )
    where = str(run.url) if mode == "online" else f"{Path(run.dir).parent} (offline: `wandb sync` uploads it)"
    try:
        for version in versions:
            aliases = [f"registry-{version.name}", *sorted(version.aliases)]
            run.log_artifact(model_artifact(version, artifact), aliases=aliases)
    finally:
        run.finish()
    sent = [stamp({"event": "mirrored", "version": v.number, **mirrored_view(v), "to": where}) for v in versions]
    registry.ledger.append(lambda events: sent)
    return versions, where


def model_artifact(version: Version, name: str) -> wandb.Artifact:
    lineage = {key: value for key, value in version.lineage.items() if key != "config"}
    metadata = {
        "registry_version": version.number,
        "digest": version.digest,
        "run": version.run,
        "step": version.step,
        "validation": version.validation,
        "parents": version.parents,
        "taint": version.taint,
        "lineage": lineage,
    }
    artifact = wandb.Artifact(name, type="model", metadata=metadata)
    path = Path(version.path)
    artifact.add_reference(path.as_uri(), name=path.name)
    return artifact


def mirror_if_online(registry: Registry, project: str = PROJECT, artifact: str = ARTIFACT) -> str:
    """Mirror the waiting versions now if W&B credentials allow, and say so; without them, nothing (a registry
    used offline would hear it after every change: `pretrain-registry list` says how many wait)."""
    if not online():
        return ""
    mirrored, where = mirror(registry, project, artifact)
    return f"W&B: mirrored {len(mirrored)} version(s) to {where}" if mirrored else ""


def waiting_note(registry: Registry) -> str:
    """How many versions W&B has not seen, and how to mirror them; empty when none wait."""
    count = len(waiting(registry.state()))
    if not count:
        return ""
    return (
        f"W&B: {count} version(s) wait to be mirrored; `pretrain-registry mirror` mirrors them once `wandb login` "
        "has run (or, with WANDB_MODE=offline, into an offline run for `wandb sync`)"
    )
