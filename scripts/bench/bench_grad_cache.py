"""Peak memory of one contrastive training step at a large batch with GradCache (`model.grad_cache_chunk`), as a
ratio to `contrastive_tiny`'s batch of 512 without it, measured in this run.

    python scripts/bench/bench_grad_cache.py [--batch 4096] [--chunk 256] [hydra overrides ...]

`contrastive_tiny`'s model (its config composed as `pretrain` composes it, with the pairs' tokenizer) takes one
forward and backward of the training loss on random pairs of full length (`data.format`'s query and passage
lengths, no padding: the most a batch computes); each way runs in a fresh process, which prints its peak resident
memory (`ru_maxrss`), with glibc told to map every block of 64 KiB or more on its own
(`MALLOC_MMAP_THRESHOLD_=65536`), so that a freed block leaves the resident set: glibc's default keeps freed heap
pages, and the peak then measures the allocator's history more than what the step needs (many chunks allocated and
freed in turn). `--default-malloc` measures with the default:

- `build`: the model and a step of 2 pairs, the baseline (Python, torch, the template, the model);
- `512`: `contrastive_tiny`'s global batch, the whole batch through the towers at once (today's step);
- `B whole`: the large batch at once, what the pool of B negatives costs without GradCache;
- `B chunked`: the large batch, the towers `--chunk` pairs at a time.

The step with GradCache has the same gradient as the whole one (`tests/test_contrastive.py`); the goal is that
B pairs chunked need no more memory than 512 whole.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def step(pairs: int, chunk: int | None, overrides: list[str]) -> dict[str, float]:
    """In this process: build the model, take one forward and backward of `pairs` pairs; the peak and the time."""
    import torch

    from pretraining.data.tokenizer import CLS_ID
    from pretraining.instantiate import build
    from pretraining.objectives.base import build_objective

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=["experiment=contrastive_tiny", f"model.grad_cache_chunk={chunk or 'null'}", *overrides]
        )
    examples = build(cfg.data.format)(build(cfg.tokenizer))
    model = build_objective(cfg.model, examples)
    generator = torch.Generator().manual_seed(0)

    def side(length: int) -> torch.Tensor:
        tokens = torch.randint(CLS_ID + 1, examples.tokenizer.vocab_size, (pairs, length), generator=generator)
        return tokens.index_fill(1, torch.tensor([0]), CLS_ID)

    batch = {"query": side(cfg.data.format.query_len), "passage": side(cfg.data.format.passage_len)}
    start = time.perf_counter()
    model.training_loss(batch).backward()
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"peak": peak, "seconds": took}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--default-malloc", action="store_true", help="measure under glibc's default thresholds")
    parser.add_argument("--pairs", type=int, help=argparse.SUPPRESS)  # one measurement, in a child process
    parser.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.pairs:
        print(json.dumps(step(args.pairs, args.chunk if args.chunked else None, overrides)))
        return
    ways = {"build": (2, False), "512": (512, False), f"{args.batch} whole": (args.batch, False)}
    ways[f"{args.batch} chunked"] = (args.batch, True)
    environment = {**os.environ, **({} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": "65536"})}
    results = {}
    for way, (pairs, chunked) in ways.items():
        command = [sys.executable, __file__, "--pairs", str(pairs), "--chunk", str(args.chunk), *overrides]
        command += ["--chunked"] if chunked else []
        finished = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
        results[way] = json.loads(finished.stdout)
    baseline, today = results["build"]["peak"], results["512"]["peak"]
    allocator = "glibc's default" if args.default_malloc else "blocks of 64 KiB and more mmapped"
    print(f"contrastive_tiny, one forward and backward; GradCache chunks of {args.chunk} pairs; {allocator}\n")
    print(f"{'way':<14} {'peak GiB':>9} {'over build GiB':>15} {'/ 512 over build':>17} {'seconds':>8}")
    for way, result in results.items():
        peak = result["peak"]
        print(
            f"{way:<14} {peak / 2**30:>9.2f} {(peak - baseline) / 2**30:>15.2f} "
            f"{(peak - baseline) / (today - baseline):>17.2f} {result['seconds']:>8.1f}"
        )


if __name__ == "__main__":
    main()
