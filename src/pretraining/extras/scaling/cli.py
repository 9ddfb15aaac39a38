"""`pretrain-scaling coordinates`: the coordinate check of a parametrization against standard's, as a table of
growth exponents, its records (JSON) and the figure (PNG, with the plots extra)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretraining.errors import ConfigError, MissingExtraError
from pretraining.files import write_atomically

# The rule each axis checks: width is µP's, depth CompleteP's (which includes µP).
SWITCH = {"width": "mup", "depth": "completep"}
SIZES = {"width": "32 64 128 256 512", "depth": "2 4 8 16"}


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-scaling coordinates [--along width|depth] ...`."""
    args = scaling_parser().parse_args(argv)
    try:
        coordinates(args)
    except ConfigError as error:
        sys.exit(f"pretrain-scaling: {error}")


def scaling_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain-scaling", description="Scaling checks of a parametrization.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("coordinates", help="activation sizes against width or depth (docs/scaling.md)")
    check.add_argument("--along", choices=SWITCH, default="width")
    check.add_argument(
        "--sizes", type=int, nargs="+", help=f"widths or depths (default: {SIZES['width']}; {SIZES['depth']})"
    )
    check.add_argument("--backbone", choices=("llama", "gpt2"), default="llama")
    check.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    check.add_argument("--lr", type=float, help="AdamW's (Muon's is 20x): default 1e-2 with adamw, 1e-3 with muon")
    check.add_argument("--steps", type=int, default=10)
    check.add_argument("--out", type=Path, default=Path("logs/scaling"), metavar="DIR")
    return parser


def coordinates(args: argparse.Namespace) -> None:
    """Run the check along `args.along`, print the exponents, write the records and draw the figure."""
    from pretraining.extras.scaling.coordinates import SHOWN, as_rows, check, growth

    shape, lr = checked_shape(args)
    checks = {
        name: check(args.backbone, name, args.optimizer, steps=args.steps, lr=lr, **shape)
        for name in ("standard", SWITCH[args.along])
    }
    stem = args.out / f"coordinates-{args.along}-{args.backbone}-{args.optimizer}"
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {name: as_rows(records) for name, records in checks.items()}
    write_atomically(stem.with_suffix(".json"), json.dumps(rows, indent=1).encode())
    print(f"growth exponent of each size against {args.along} at step {args.steps} (0: flat, 1: proportional)")
    print(f"{'':12}" + "".join(f"{layer:>12}" for layer in SHOWN))
    for name, records in checks.items():
        print(f"{name:12}" + "".join(f"{growth(records, layer, args.steps, args.along):+12.2f}" for layer in SHOWN))
    print(stem.with_suffix(".json"))
    if importlib.util.find_spec("matplotlib") is None or importlib.util.find_spec("pretraining.extras.plots") is None:
        print(f"no figure: {MissingExtraError('drawing it (matplotlib, the plots extra)', 'plots')}")
        return
    from pretraining.extras.scaling.figures import coordinate_figure

    title = f"{args.backbone}, {args.optimizer} (LR {lr:g}): activation size against {args.along}"
    coordinate_figure(checks, args.along, title, stem.with_suffix(".png"))
    print(stem.with_suffix(".png"))


def checked_shape(args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """The sizes and base of the check, and its learning rate, once the arguments are checked."""
    sizes = args.sizes or [int(size) for size in SIZES[args.along].split()]
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ConfigError(f"--sizes {sizes}: give two different {args.along}s or more, each at least 1")
    if args.steps < 1 or (args.lr is not None and args.lr <= 0):
        raise ConfigError(f"--steps {args.steps} --lr {args.lr}: train at least one step at a positive rate")
    if args.along == "width" and any(size % 8 for size in sizes):
        raise ConfigError(f"--sizes {sizes}: each width a multiple of 8 (4 heads of an even width)")
    lr = args.lr if args.lr is not None else (1e-2 if args.optimizer == "adamw" else 1e-3)
    if args.along == "width":
        return {"widths": sizes, "base_width": sizes[0]}, lr
    return {"depths": sizes, "base_depth": sizes[0], "widths": (64,), "base_width": 64}, lr
