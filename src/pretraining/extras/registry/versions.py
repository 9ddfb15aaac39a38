"""Registered checkpoints: versions, aliases with their history, taints; replayed from the ledger.

A version is a checkpoint, keyed by its digest (`pretraining.checkpoint.checkpoint_digest`), numbered
in the order of registration. The registry never copies, moves or deletes a checkpoint: it records
where it was and what it was, and says when the file there is gone or changed.
"""

from __future__ import annotations

import datetime
import getpass
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretraining.checkpoint import (
    CheckpointError,
    checkpoint_digest,
    existing_checkpoint,
    read_lineage,
    sidecar_digest,
    verify,
)
from pretraining.errors import ConfigError
from pretraining.extras.registry.ledger import Event, Ledger

ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # not a number, and no dot or slash: never a file's name
VERSION = re.compile(r"v?([0-9]+)")
RESERVED_ALIASES = {"latest"}  # W&B gives it to the newest artifact version itself
# What a version records of its step's metrics (a sidecar also holds train/ and data/ ones).
VALIDATION_PREFIXES = ("val/", "probe/")


@dataclass
class Version:
    """One registered checkpoint, as the ledger records it, with its current aliases and taint."""

    number: int
    digest: str
    path: str
    run: str
    step: int
    lineage: dict[str, Any]
    validation: dict[str, float]
    parents: list[int]
    registered: str  # when, by whom
    aliases: list[str] = field(default_factory=list)
    taint: str | None = None

    @property
    def name(self) -> str:
        return f"v{self.number}"


@dataclass
class State:
    """The registry as its events leave it."""

    versions: dict[int, Version] = field(default_factory=dict)
    aliases: dict[str, int | None] = field(default_factory=dict)  # None: cleared by a taint
    alias_events: dict[str, list[Event]] = field(default_factory=dict)
    # Where each alias has pointed, as a stack: a move pushes, a rollback pops back to its target.
    alias_stacks: dict[str, list[int | None]] = field(default_factory=dict)
    mirrored: dict[int, Event] = field(default_factory=dict)  # the last W&B mirroring of each version

    def by_digest(self, digest: str) -> Version | None:
        return next((version for version in self.versions.values() if version.digest == digest), None)


def replay(events: list[Event], source: Path | None = None) -> State:
    """The registry as `events` (the lines of the ledger `source`) leave it."""
    state = State()
    for line, event in enumerate(events, 1):
        try:
            apply(state, event)
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise ConfigError(
                f"line {line} of the registry ledger {source} is not a registry event ({error!r}): the file was "
                "edited by hand; restore it from a backup (the registry only ever appends to it)"
            ) from None
    for alias, target in state.aliases.items():
        if target is not None:
            state.versions[target].aliases.append(alias)
    return state


def apply(state: State, event: Event) -> None:
    kind = event["event"]
    if kind == "register":
        if event["number"] in state.versions:  # a number names one checkpoint for good
            raise ValueError(f"v{event['number']} is registered already")
        fields = {key: event[key] for key in Version.__dataclass_fields__ if key in event and key != "registered"}
        state.versions[event["number"]] = Version(**fields, registered=f"{event['time']} by {event['by']}")
    elif kind == "alias":
        alias, target = event["alias"], event["version"]
        if target is not None and target not in state.versions:
            raise KeyError(target)
        stack = state.alias_stacks.setdefault(alias, [])
        if event.get("rollback"):
            del stack[stack.index(target) + 1 :]
        else:
            stack.append(target)
        state.aliases[alias] = target
        state.alias_events.setdefault(alias, []).append(event)
    elif kind == "taint":
        state.versions[event["version"]].taint = event["why"]
    elif kind == "mirrored":
        state.mirrored[event["version"]] = event
    else:
        raise ValueError(f"unknown event {kind!r}")


def stamp(event: Event) -> Event:
    """`event` with when and by whom."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user without a name
        user = str(os.getuid())
    return {**event, "time": now, "by": f"{user}@{socket.gethostname()}"}


class Registry:
    """The registry kept in `directory` (`paths.registry_dir`, or `--registry DIR`)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.ledger = Ledger(self.directory)

    def state(self) -> State:
        return replay(self.ledger.events(), self.ledger.path)

    def register(self, path: Path, alias: str | None = None) -> tuple[Version, bool]:
        """Register the checkpoint at `path` (refused unless it verifies against its sidecar), or find it
        registered already; with `alias`, point the alias at it. Returns the version and whether it is new."""
        path = existing_checkpoint(path).resolve()
        sidecar = verify(path)
        digest = sidecar_digest(sidecar)
        lineage = read_lineage(path)
        if alias is not None:
            check_alias_name(alias)

        def decide(events: list[Event]) -> list[Event]:
            state = replay(events, self.ledger.path)
            known = state.by_digest(digest)
            new: list[Event] = []
            if known is None:
                number = max(state.versions, default=0) + 1
                record = {
                    "event": "register",
                    "number": number,
                    "digest": digest,
                    "path": str(path),
                    "run": run_of(path),
                    "step": sidecar["step"],
                    "lineage": lineage,
                    "validation": {
                        name: value
                        for name, value in (sidecar.get("validation") or {}).items()
                        if name.startswith(VALIDATION_PREFIXES)
                    },
                    "parents": parents(state, path, lineage),
                }
                new.append(stamp(record))
                apply(state, new[-1])
            version = state.by_digest(digest)
            assert version is not None
            if alias is not None and state.aliases.get(alias) != version.number:
                refuse_tainted(version, f"an alias ({alias})", "register it without --alias")
                new.append(stamp({"event": "alias", "alias": alias, "version": version.number, "why": "register"}))
            return new

        written = self.ledger.append(decide)
        state = self.state()
        version = state.by_digest(digest)
        assert version is not None
        return version, any(event["event"] == "register" for event in written)

    def resolve(self, reference: str, state: State | None = None) -> Version:
        """The version `reference` names: a version number (`3` or `v3`), an alias, or a checkpoint's path
        (hashed: to resolve one under the ledger's lock, `pin` it first)."""
        state = state or self.state()
        number = VERSION.fullmatch(reference)
        if number:
            version = state.versions.get(int(number[1]))
            if version is None:
                raise ConfigError(f"the registry {self.directory} has no version {reference} ({describe(state)})")
            return version
        if ALIAS.fullmatch(reference):
            if reference not in state.aliases:
                raise ConfigError(
                    f"{reference!r} is no alias of the registry {self.directory} ({describe(state)}), nor a checkpoint"
                )
            target = state.aliases[reference]
            if target is None:
                raise ConfigError(
                    f"the alias {reference!r} points at no version: its last version was tainted; move it with "
                    f"`pretrain-registry rollback {reference}` or `promote REF {reference}`"
                )
            return state.versions[target]
        path = Path(reference)
        if not path.exists():
            raise ConfigError(f"{reference}: no such checkpoint (a REF is an alias, a version such as v3, or a path)")
        found = state.by_digest(sidecar_digest(verify(path.resolve())))
        if found is None:
            raise ConfigError(f"{path} is not registered in {self.directory}: `pretrain-registry register {path}`")
        return found

    def pin(self, reference: str) -> str:
        """`reference` as a version number if it is a path: a checkpoint is hashed before the ledger is locked,
        not while other writers wait."""
        if VERSION.fullmatch(reference) or ALIAS.fullmatch(reference):
            return reference
        return self.resolve(reference).name

    def promote(self, reference: str, alias: str) -> Version | None:
        """Point `alias` at the version `reference` names; None if it already did."""
        check_alias_name(alias)
        reference = self.pin(reference)

        def decide(events: list[Event]) -> list[Event]:
            state = replay(events, self.ledger.path)
            version = self.resolve(reference, state)
            refuse_tainted(version, f"an alias ({alias})", "promote an untainted version")
            if state.aliases.get(alias) == version.number:
                return []
            return [stamp({"event": "alias", "alias": alias, "version": version.number, "why": "promote"})]

        return self.alias_moved(self.ledger.append(decide))

    def taint(self, reference: str, why: str) -> Version:
        """Mark a version bad: it leaves its aliases, and teachers, `init_from` and exports refuse it."""
        if not why.strip():
            raise ConfigError("say why the version is bad: --why '...'")
        reference = self.pin(reference)

        def decide(events: list[Event]) -> list[Event]:
            state = replay(events, self.ledger.path)
            version = self.resolve(reference, state)
            if version.taint is not None:
                raise ConfigError(f"{version.name} is tainted already: {version.taint}")
            cleared = [
                stamp({"event": "alias", "alias": alias, "version": None, "why": f"taint of {version.name}"})
                for alias in version.aliases
            ]
            return [stamp({"event": "taint", "version": version.number, "why": why}), *cleared]

        written = self.ledger.append(decide)
        return self.state().versions[written[0]["version"]]

    def rollback(self, alias: str) -> Version:
        """Move `alias` back to the version it pointed at before its current one, passing over tainted ones;
        rolling back again goes further back."""

        def decide(events: list[Event]) -> list[Event]:
            state = replay(events, self.ledger.path)
            self.check_alias_known(alias, state)
            current = state.aliases[alias]
            for number in reversed(state.alias_stacks[alias][:-1]):
                if number is not None and state.versions[number].taint is None:
                    why = f"rollback from {f'v{current}' if current else 'no version'}"
                    event = {"event": "alias", "alias": alias, "version": number, "why": why, "rollback": True}
                    return [stamp(event)]
            raise ConfigError(
                f"the alias {alias!r} has no earlier untainted version to go back to: promote one with "
                f"`pretrain-registry promote REF {alias}`"
            )

        moved = self.alias_moved(self.ledger.append(decide))
        assert moved is not None
        return moved

    def alias_moved(self, written: list[Event]) -> Version | None:
        return self.state().versions[written[0]["version"]] if written else None

    def history(self, alias: str) -> list[Event]:
        state = self.state()
        self.check_alias_known(alias, state)
        return state.alias_events[alias]

    def check_alias_known(self, alias: str, state: State) -> None:
        if alias not in state.aliases:
            raise ConfigError(f"the registry {self.directory} has no alias {alias!r} ({describe(state)})")

    def taint_of(self, digest: str) -> Version | None:
        """The registered version with this digest if it is tainted (no registry: nothing is)."""
        version = self.state().by_digest(digest)
        return version if version is not None and version.taint is not None else None


def refuse_tainted(version: Version, use: str, fix: str) -> None:
    if version.taint is not None:
        raise ConfigError(f"{version.name} ({version.path}) is tainted ({version.taint}): not usable as {use}; {fix}")


def check_not_tainted(registry: Registry, digest: str, what: str, use: str, force: str) -> None:
    """Refuse a checkpoint (by digest) tainted in `registry` for `use`, unless the user forces it with `force`."""
    version = registry.taint_of(digest)
    if version is not None:
        raise ConfigError(
            f"{what} is registry version {version.name} in {registry.directory}, tainted: {version.taint}. "
            f"It is not used as {use} unless you force it with {force}"
        )


def check_alias_name(alias: str) -> None:
    if not ALIAS.fullmatch(alias) or VERSION.fullmatch(alias) or alias in RESERVED_ALIASES:
        raise ConfigError(
            f"alias {alias!r}: an alias starts with a letter and holds letters, digits, '_' and '-' (and is not a "
            f"version number such as v3, nor {', '.join(sorted(RESERVED_ALIASES))}, W&B's own)"
        )


def run_of(path: Path) -> str:
    """The run a checkpoint belongs to: the directory holding its `checkpoints/` directory."""
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.parent.name


def parents(state: State, path: Path, lineage: dict[str, Any]) -> list[int]:
    """The registered versions a checkpoint descends from: the newest earlier registered checkpoint of its
    own run, the teacher it was distilled from and the checkpoint its run's first weights were exported from."""
    found = set()
    same_run = [
        version
        for version in state.versions.values()
        if Path(version.path).parent == path.parent and version.step < lineage["step"]
    ]
    if same_run:
        found.add(max(same_run, key=lambda version: version.step).number)
    teacher = (lineage.get("teacher") or {}).get("digest")
    exported = ((lineage.get("origin") or {}).get("exported_from") or {}).get("checkpoint_sha256")
    for digest in (teacher, exported and checkpoint_digest(exported)):
        version = state.by_digest(digest) if digest else None
        if version is not None:
            found.add(version.number)
    return sorted(found)


def file_status(version: Version) -> str:
    """ "ok", or what became of the registered checkpoint's file."""
    path = Path(version.path)
    if not path.exists():
        return f"gone: nothing at {path} any more"
    try:
        digest = sidecar_digest(verify(path))
    except CheckpointError as error:
        return f"changed: {error}"
    return "ok" if digest == version.digest else "changed: another checkpoint is at this path now"


def describe(state: State) -> str:
    """The registry's contents in a phrase, for an error message."""
    if not state.versions:
        return "it is empty: `pretrain-registry register CKPT` adds a checkpoint"
    aliases = ", ".join(sorted(state.aliases)) or "none"
    return f"versions v1-v{max(state.versions)}, aliases: {aliases}"
