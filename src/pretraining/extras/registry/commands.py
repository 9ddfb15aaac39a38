"""What `pretrain-registry`'s verbs do and print (`pretraining.cli.registry` parses them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pretraining.extras.registry.mirror import ARTIFACT, PROJECT, mirror, mirror_if_online, waiting_note
from pretraining.extras.registry.versions import Registry, Version, file_status

# The metrics a listing shows, the first a version has.
HEADLINE_METRICS = ("val/bpb", "val/accuracy", "val/q2p_mrr", "val/loss")


def headline(version: Version) -> str:
    for name in HEADLINE_METRICS:
        if name in version.validation:
            return f"{name} {version.validation[name]:.4g}"
    return "not validated"


def line(version: Version) -> str:
    aliases = f" [{', '.join(sorted(version.aliases))}]" if version.aliases else ""
    taint = f" TAINTED: {version.taint}" if version.taint else ""
    return f"{version.name:>5}{aliases} {version.run} step {version.step}, {headline(version)}{taint}"


def wandb_target(args: argparse.Namespace) -> tuple[str, str]:
    return args.wandb_project or PROJECT, args.wandb_artifact or ARTIFACT


def after_change(registry: Registry, args: argparse.Namespace) -> None:
    note = mirror_if_online(registry, *wandb_target(args))
    if note:
        print(note)


def register(registry: Registry, args: argparse.Namespace) -> None:
    version, new = registry.register(args.checkpoint, args.alias)
    print(f"{'registered' if new else 'already registered:'} {line(version)}\n       {version.path}")
    after_change(registry, args)


def list_versions(registry: Registry, args: argparse.Namespace) -> None:
    state = registry.state()
    if not state.versions:
        print(f"the registry {registry.directory} is empty: `pretrain-registry register CKPT` adds a checkpoint")
    for version in state.versions.values():
        gone = "" if Path(version.path).exists() else " (file gone)"
        print(line(version) + gone)
    note = waiting_note(registry)
    if note:
        print(note)


def show(registry: Registry, args: argparse.Namespace) -> None:
    version = registry.resolve(args.reference)
    record = {key: value for key, value in vars(version).items() if key != "lineage" or args.config}
    if not args.config:
        record["lineage"] = {key: value for key, value in version.lineage.items() if key != "config"}
    record["file"] = file_status(version)
    print(json.dumps(record, indent=1, default=str) if args.json else described(record))


def described(record: dict[str, Any]) -> str:
    rows = [
        (key, json.dumps(value, default=str) if isinstance(value, dict | list) else str(value))
        for key, value in record.items()
    ]
    return "\n".join(f"{key + ':':<12} {value}" for key, value in rows)


def pointed(registry: Registry, alias: str) -> str:
    """What `alias` points at now, in words."""
    aliases = registry.state().aliases
    return "new" if alias not in aliases else f"v{aliases[alias]}" if aliases[alias] else "no version"


def promote(registry: Registry, args: argparse.Namespace) -> None:
    before = pointed(registry, args.alias)
    version = registry.promote(args.reference, args.alias)
    if version is None:
        print(f"{args.alias} already points at {before}")
        return
    print(f"{args.alias}: {before} -> {version.name}")
    after_change(registry, args)


def taint(registry: Registry, args: argparse.Namespace) -> None:
    aliases = registry.resolve(args.reference).aliases
    version = registry.taint(args.reference, args.why)
    left = f"; removed from {', '.join(aliases)} (`pretrain-registry rollback ALIAS` moves one back)" if aliases else ""
    print(f"{version.name} tainted: {version.taint}{left}")
    after_change(registry, args)


def rollback(registry: Registry, args: argparse.Namespace) -> None:
    before = pointed(registry, args.alias)
    version = registry.rollback(args.alias)
    print(f"{args.alias}: {before} -> {version.name}")
    after_change(registry, args)


def history(registry: Registry, args: argparse.Namespace) -> None:
    for event in registry.history(args.alias):
        target = f"v{event['version']}" if event["version"] else "no version"
        print(f"{event['time']}  {target:<11} {event['why']:<22} by {event['by']}")


def mirror_waiting(registry: Registry, args: argparse.Namespace) -> None:
    mirrored, where = mirror(registry, *wandb_target(args))
    if not mirrored:
        print("W&B has seen every version whose file is still there")
        return
    print(f"mirrored {', '.join(version.name for version in mirrored)} to {where}")
