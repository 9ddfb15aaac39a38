"""`pretrain-evals build`: write the bundled evaluation suite (docs/evals.md) from the validation split of the
default data. Its work is imported once the arguments parse."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def positive(text: str) -> int:
    """`--items`, `--max-bytes`: a whole number, 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


def parser() -> argparse.ArgumentParser:
    """The arguments of `pretrain-evals`."""
    evals = argparse.ArgumentParser(prog="pretrain-evals", description="The evaluation extra's commands.")
    commands = evals.add_subparsers(dest="command", required=True)
    build = commands.add_parser(
        "build",
        help="write the bundled suite",
        description="Write the bundled suite (next-line and function-name multiple choice, docstring-to-code "
        "retrieval, held-out text) from the validation split of text shards, leaving out whatever occurs in the "
        "training split of the text or pair shards. The suite is replaced whole, or left as it was.",
    )
    build.add_argument("--data", type=Path, default=Path("data/stdlib"), help="text shards (default: %(default)s)")
    build.add_argument(
        "--pairs", type=Path, default=Path("data/stdlib_pairs"), help="pair shards (default: %(default)s)"
    )
    build.add_argument("--out", type=Path, default=Path("data/evals"), help="the suite (default: %(default)s)")
    build.add_argument("--seed", type=int, default=0, help="draws the items (default: %(default)s)")
    build.add_argument("--items", type=positive, default=500, help="the most items a task (default: %(default)s)")
    build.add_argument(
        "--max-bytes",
        type=positive,
        default=256,
        help="the longest item (context and choice, or text) in UTF-8 bytes, within a byte-level model's "
        "max_seq_len (default: %(default)s)",
    )
    return evals


def main(argv: Sequence[str] | None = None) -> None:
    """`pretrain-evals build [--data DIR] [--pairs DIR] [--out DIR] [--seed N] [--items N] [--max-bytes N]`."""
    args = parser().parse_args(argv)
    from pretraining.errors import PretrainingError
    from pretraining.extras.evals.build import build_suite

    start = time.perf_counter()
    try:
        suite = build_suite(args.data, args.pairs, args.out, args.seed, args.items, args.max_bytes)
    except (PretrainingError, OSError) as error:  # shards that cannot be used, a suite that cannot be written
        sys.exit(f"pretrain-evals: {error}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s:")
    for name, task in suite["tasks"].items():
        chance = ", ".join(f"{metric} {value:.3g}" for metric, value in task["chance"].items())
        print(f"  {name} ({task['kind']}): {task['items']} items, chance {chance}")
