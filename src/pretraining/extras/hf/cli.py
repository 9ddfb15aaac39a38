"""`pretrain-export CKPT OUT`: a Hugging Face model directory. Its work is imported once the arguments parse
(torch takes seconds to load)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pretraining.errors import PretrainingError

try:  # the registry extra, where this fork keeps it: tainted checkpoints are refused
    from pretraining.extras.registry import REGISTRY_DIR
except ModuleNotFoundError:
    REGISTRY_DIR = None  # type: ignore[assignment]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pretrain-export", description="Export a checkpoint as a Hugging Face model directory."
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint file or sharded directory (or last.ckpt)")
    parser.add_argument("out", type=Path, help="the directory to write (new, or empty)")
    parser.add_argument("--tokenizer", help="where the run's BPE tokenizer.json is now, if it moved")
    parser.add_argument(
        "--trusted-targets", nargs="*", default=[], help="modules whose classes the stored config may build"
    )
    if REGISTRY_DIR is not None:
        parser.add_argument(
            "--registry", type=Path, default=REGISTRY_DIR, metavar="DIR", help="the registry (default: logs/registry)"
        )
        parser.add_argument("--allow-tainted", action="store_true", help="export a checkpoint the registry taints")
    args = parser.parse_args(argv)
    registry = getattr(args, "registry", None)
    if registry is not None and registry != REGISTRY_DIR and not registry.is_dir():  # a mistyped one finds no taint
        parser.error(f"--registry {registry}: no such directory")
    from pretraining.extras.hf.export import export, usage

    try:
        kind = export(
            args.checkpoint,
            args.out,
            args.tokenizer,
            args.trusted_targets,
            registry,
            getattr(args, "allow_tainted", False),
        )
    except (PretrainingError, OSError) as error:  # OSError: also a disk that fills or a directory not writable
        sys.exit(f"pretrain-export: {error}")
    print(f"wrote {args.out} ({kind}); load it with:\n{usage(kind, args.out)}")
