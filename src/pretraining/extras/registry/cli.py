"""`pretrain-registry VERB ...`: the registry's command. Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pretraining.errors import PretrainingError
from pretraining.extras.registry import REGISTRY_DIR


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-registry VERB ...`: register checkpoints, move aliases, taint and roll back."""
    args = registry_parser().parse_args(argv)
    from pretraining.extras.registry import commands
    from pretraining.extras.registry.versions import Registry

    try:
        getattr(commands, args.verb)(Registry(args.registry), args)
    except (PretrainingError, OSError) as error:  # OSError: a disk that fills, a directory not writable
        sys.exit(f"pretrain-registry {args.command}: {error}")


def registry_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain-registry",
        description="A ledger of chosen checkpoints: versions, aliases that move with history, taints, rollback.",
    )
    parser.add_argument(
        "--registry",
        type=Path,
        default=REGISTRY_DIR,
        metavar="DIR",
        help="the registry's directory (default: logs/registry, as paths.registry_dir)",
    )
    parser.add_argument("--wandb-project", help="the W&B project it is mirrored to (default: pretraining)")
    parser.add_argument("--wandb-artifact", help="the W&B model artifact's name (default: pretraining-models)")
    verbs = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    reference = "an alias, a version (3 or v3) or a checkpoint path"

    def verb(name: str, function: str, text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=text, description=text)
        sub.set_defaults(verb=function)
        return sub

    sub = verb("register", "register", "add a checkpoint (it must verify against its sidecar)")
    sub.add_argument("checkpoint", type=Path)
    sub.add_argument("--alias", help="also point this alias at it")
    verb("list", "list_versions", "every version, with its aliases and taint")
    sub = verb("show", "show", "one version: its record, lineage, and whether its file is still there")
    sub.add_argument("reference", help=reference)
    sub.add_argument("--json", action="store_true", help="as JSON")
    sub.add_argument("--config", action="store_true", help="with the full config it was trained with")
    sub = verb("promote", "promote", "point an alias at a version")
    sub.add_argument("reference", help=reference)
    sub.add_argument("alias")
    sub = verb("taint", "taint", "mark a version bad: off its aliases, refused as teacher, init_from or export")
    sub.add_argument("reference", help=reference)
    sub.add_argument("--why", required=True, help="the reason, recorded")
    sub = verb("rollback", "rollback", "move an alias back to its previous untainted version")
    sub.add_argument("alias")
    sub = verb("history", "history", "where an alias has pointed, when and why")
    sub.add_argument("alias")
    verb("mirror", "mirror_waiting", "log the versions W&B has not seen (online, or offline with WANDB_MODE=offline)")
    return parser
