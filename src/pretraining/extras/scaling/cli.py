"""`pretrain-scaling coordinates`: the coordinate check of a parametrization against standard's, as a table of
growth exponents, its records (JSON) and the figure (PNG, with the plots extra). `pretrain-scaling ladder`: the
scaling ladder (`ladder`), its rungs, fits and prediction (JSON, CSV) and their figure."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pretraining.errors import ConfigError, MissingExtraError, PretrainingError
from pretraining.files import write_atomically

# The rule each axis checks: width is µP's, depth CompleteP's (which includes µP).
SWITCH = {"width": "mup", "depth": "completep"}
SIZES = {"width": "32 64 128 256 512", "depth": "2 4 8 16"}
# The ladder's shapes (width x depth): two layers at least (one cannot compose two attention heads), deeper as they
# widen (d_model / n_layer from 12 to 24); non-embedding parameters from 14k to 443k (32x), then 866k (2x) to
# predict. Widths are multiples of 24, where the gated MLP's 8/3 d_model is a multiple of 64 as the backbone rounds
# it: at others (32: 128 wide, 4 d_model) a rung's MLP is out of proportion. docs/scaling.md.
RUNGS, NEXT = ("24x2", "48x2", "48x4", "72x3", "96x4"), "120x5"


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-scaling coordinates [--along width|depth] ...`."""
    args = scaling_parser().parse_args(argv)
    from hydra.errors import HydraException

    try:
        {"coordinates": coordinates, "ladder": ladder}[args.command](args)
    except (PretrainingError, HydraException) as error:
        sys.exit(f"pretrain-scaling {args.command}: {error}")


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
    ladder = commands.add_parser("ladder", help="train shapes, fit power laws, predict the next (docs/scaling.md)")
    ladder.add_argument("--shapes", type=shape, nargs="+", default=list(map(shape, RUNGS)), metavar="WxD")
    ladder.add_argument("--next", type=shape, default=shape(NEXT), metavar="WxD", help="predicted, then trained")
    ladder.add_argument("--tokens-per-parameter", type=float, default=20.0, metavar="RATIO")
    ladder.add_argument("--out", type=Path, default=Path("logs/scaling/ladder"), metavar="DIR")
    ladder.add_argument("overrides", nargs="*", help="pretrain's, for every rung (default: experiment=ladder)")
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
    if not can_draw():
        return
    from pretraining.extras.scaling.figures import coordinate_figure

    title = f"{args.backbone}, {args.optimizer} (LR {lr:g}): activation size against {args.along}"
    coordinate_figure(checks, args.along, title, stem.with_suffix(".png"))
    print(stem.with_suffix(".png"))


def ladder(args: argparse.Namespace) -> None:
    """Climb the ladder; a signal's stop exits 128 + its number, as `pretrain` does (a scheduler requeues on it)."""
    if importlib.util.find_spec("scipy") is None:
        raise MissingExtraError("the ladder's fits (scipy)", "scaling")
    from pretraining.extras.scaling.ladder import LadderStopped

    try:
        climb(args)
    except LadderStopped as stopped:
        print(f"pretrain-scaling ladder: {stopped}", file=sys.stderr)
        sys.exit(stopped.status)


def climb(args: argparse.Namespace) -> None:
    """Train the fitted rungs, fit, predict the next rung, train it and report the error; write the files."""
    from pretraining.extras.scaling.ladder import Ladder, check_overrides, plan, summary, train, write

    if len(args.shapes) < 4 or args.tokens_per_parameter <= 0:
        raise ConfigError(
            f"--shapes {' '.join(map(shape_name, args.shapes))} --tokens-per-parameter {args.tokens_per_parameter}: "
            "four shapes or more (the fit has three parameters), at a positive ratio"
        )
    check_overrides(args.overrides)
    overrides = ["experiment=ladder", *args.overrides]
    *fitted, following = plan([*args.shapes, args.next], args.tokens_per_parameter, overrides)
    sizes = [rung.parameters for rung in [*fitted, following]]
    if sizes != sorted(set(sizes)):
        raise ConfigError(
            f"--shapes ... --next: parameters {sizes}; give the shapes smallest first, each larger than the last, "
            "and --next the largest"
        )
    settings = {"tokens_per_parameter": args.tokens_per_parameter, "overrides": overrides}
    result = Ladder(fitted, [train(rung, overrides, args.out) for rung in fitted], following)
    write(result, args.out, settings)  # the prediction, on file before its rung trains
    print("\n".join(summary(result)))
    result.measured = train(following, overrides, args.out)
    write(result, args.out, settings)
    print("\n".join(summary(result)))
    print(args.out / "ladder.json")
    print(args.out / "ladder.csv")
    if not can_draw():
        return
    from pretraining.extras.scaling.figures import ladder_figure

    ladder_figure(result, args.out / "ladder.png")
    print(args.out / "ladder.png")


def shape(text: str) -> tuple[int, int]:
    """`WIDTHxDEPTH` as (width, depth)."""
    width, _, depth = text.partition("x")
    if not (width.isdigit() and depth.isdigit() and int(width) > 0 and int(depth) > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is WIDTHxDEPTH, as 64x2 (d_model 64, 2 layers)")
    return int(width), int(depth)


def shape_name(size: tuple[int, int]) -> str:
    return "x".join(map(str, size))


def can_draw() -> bool:
    """Whether the plots extra is installed; if not, say so."""
    if importlib.util.find_spec("matplotlib") and importlib.util.find_spec("pretraining.extras.plots"):
        return True
    print(f"no figure: {MissingExtraError('drawing it (matplotlib, the plots extra)', 'plots')}")
    return False


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
