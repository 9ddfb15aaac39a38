"""Does the best learning rate found small hold at 8x the width and 4x the depth? Sweeps the learning rate of a
Llama next-token model at several widths (and depths), with AdamW and with Muon, under `standard` and under the
switch (`mup` for width, `completep` for depth), and prints the best learning rate of each size, how far the
smallest size's best lands from the largest's, and the loss there against the best there; the curves go to a PNG
(with the plots extra) and every loss to a JSON.

Data: the default corpus (the standard library's source) as bytes, training files and held-out files apart
(every 10th file held out); each run trains `--steps` steps of `--batch` blocks of 128 bytes with the template's
optimizer groups and warmup-cosine schedule, and is scored by its mean loss on 256 held-out blocks. Under Muon the
swept rate is `lr_scale` (both rates, from lr 3e-3 and muon_lr 0.02); under AdamW, `lr`.

    python scripts/bench/bench_transfer.py [--widths 64 128 256 512] [--depths 2 4 8] [--steps 200]
        [--optimizers adamw muon] [--axes width depth] [--rules standard switch] [--grid -3 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sysconfig
import time
from argparse import Namespace
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pretraining.models.llama import Llama
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.optimization import built_optimizer
from pretraining.objectives.optimizers import MuonAdamW
from pretraining.objectives.schedules import lr_schedule

LENGTH = 128
BASE_LR = {"adamw": 4e-3, "muon": 1.0}  # AdamW's lr; Muon's lr_scale (lr 3e-3, muon_lr 0.02)


@functools.cache
def corpus(held_out: bool) -> torch.Tensor:
    """The standard library's source as bytes: every 10th file held out, the others for training."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    chosen = [path for index, path in enumerate(files) if (index % 10 == 0) == held_out]
    return torch.frombuffer(bytearray(b"".join(path.read_bytes() for path in chosen[:4000])), dtype=torch.uint8)


def corpus_blocks(held_out: bool, count: int, seed: int = 0) -> torch.Tensor:
    """`count` random blocks of LENGTH + 1 bytes of the training (or held-out) source."""
    data = corpus(held_out)
    starts = torch.randint(0, len(data) - LENGTH - 1, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([data[start : start + LENGTH + 1] for start in starts.tolist()]).long()


def factory(optimizer: str, rate: float) -> Callable[..., torch.optim.Optimizer]:
    if optimizer == "adamw":
        return partial(torch.optim.AdamW, lr=rate, betas=(0.9, 0.95), weight_decay=0.1)
    return partial(MuonAdamW, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, muon_lr=0.02, lr_scale=rate)


def held_out_loss(
    optimizer: str,
    parametrization: str,
    width: int,
    depth: int,
    base: tuple[int, int],
    rate: float,
    steps: int,
    batch: int,
) -> float:
    """Train one model and return its mean held-out loss (nan if it diverged)."""
    torch.manual_seed(0)
    sizes: dict[str, Any] = {"vocab_size": 256, "max_seq_len": LENGTH, "d_model": width, "n_layer": depth, "n_head": 4}
    sizes |= {"parametrization": parametrization, "base_width": base[0], "base_depth": base[1]}
    model = CausalLM(Llama(**sizes), optimizer=factory(optimizer, rate))
    opt = built_optimizer(model.optimizer_factory, model)
    schedule = lr_schedule(opt, "cosine", steps // 10, 0.1, 1, steps)
    training = corpus_blocks(False, steps * batch, seed=1).view(steps, batch, -1)
    for tokens in training:
        opt.zero_grad()
        loss = model.training_loss({"tokens": tokens})
        if not torch.isfinite(loss):
            return math.nan
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    with torch.no_grad():
        return model.training_loss({"tokens": corpus_blocks(True, 256)}).item()


Curves = dict[str, dict[float, float]]  # "width x depth": {rate: held-out loss}


def sweep(
    optimizer: str, parametrization: str, shapes: list[tuple[int, int]], base: tuple[int, int], args: Namespace
) -> Curves:
    """{"width x depth": {rate: loss}} over the grid around the optimizer's base rate."""
    results: Curves = {}
    for width, depth in shapes:
        results[f"{width}x{depth}"] = {}
        for exponent in range(args.grid[0], args.grid[1] + 1):  # one grid step a factor of 2
            rate = BASE_LR[optimizer] * 2.0**exponent
            start = time.perf_counter()
            loss = held_out_loss(optimizer, parametrization, width, depth, base, rate, args.steps, args.batch)
            results[f"{width}x{depth}"][rate] = loss
            print(
                f"  {optimizer} {parametrization:9} {width:4}x{depth:<2} rate {rate:<9.3g} loss {loss:.4f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return results


def best(curve: dict[float, float]) -> float:
    finite = {rate: loss for rate, loss in curve.items() if math.isfinite(loss)}
    return min(finite, key=finite.__getitem__)


def report(name: str, results: Curves) -> None:
    """The best rate per size (and its loss); how many grid steps the smallest size's best is from the largest's;
    the largest size's loss at the smallest's best against its own best."""
    sizes = list(results)
    small, large = results[sizes[0]], results[sizes[-1]]
    steps_apart = round(math.log2(best(small) / best(large)))
    penalty = large[best(small)] / large[best(large)] - 1
    bests = ", ".join(f"{size}: {best(curve):.3g} ({curve[best(curve)]:.4f})" for size, curve in results.items())
    print(
        f"{name}: best rate {bests}; {sizes[0]}'s best is {steps_apart:+d} grid steps from {sizes[-1]}'s, "
        f"whose loss there is {penalty:+.2%} over its best"
    )


def draw(all_results: dict[str, Curves], out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pretraining.extras.plots.plots import save_png

    rows = 2 if len(all_results) > 1 else 1
    columns = math.ceil(len(all_results) / rows)
    figure = Figure(figsize=(4 * columns, 3.5 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplots(rows, columns, squeeze=False).flatten()
    for axes in panels[len(all_results) :]:
        axes.set_visible(False)
    for axes, (name, results) in zip(panels, all_results.items(), strict=False):
        for size, curve in results.items():
            rates = sorted(curve)
            axes.plot(rates, [curve[rate] for rate in rates], marker="o", label=size)
        axes.set(
            xscale="log", xlabel="learning rate" if "adamw" in name else "lr_scale", ylabel="held-out loss", title=name
        )
        axes.minorticks_off()  # a narrow log range labels its minor ticks over one another
        axes.legend(fontsize="small")
    save_png(figure, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--depth-width", type=int, default=64, help="the width of the depth sweep")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--axes", nargs="+", choices=["width", "depth"], default=["width", "depth"])
    parser.add_argument(
        "--rules",
        nargs="+",
        choices=["standard", "switch"],
        default=["standard", "switch"],
        help="switch: mup along width, completep along depth",
    )
    parser.add_argument(
        "--grid", type=int, nargs=2, default=[-3, 3], metavar=("LOW", "HIGH"), help="the rates: base x 2^LOW .. 2^HIGH"
    )
    parser.add_argument("--out", type=Path, default=Path("logs/bench/transfer"))
    args = parser.parse_args()
    print(
        f"{torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps of {args.batch} x {LENGTH} bytes"
    )
    widths = [(width, args.depths[0]) for width in args.widths]
    depths = [(args.depth_width, depth) for depth in args.depths]
    all_results: dict[str, Curves] = {}
    for optimizer in args.optimizers:
        for axis, shapes, switch in (("width", widths, "mup"), ("depth", depths, "completep")):
            if axis not in args.axes:
                continue
            for name in [switch if rule == "switch" else rule for rule in args.rules]:
                key = f"{optimizer}, {name}, {axis}"
                all_results[key] = sweep(optimizer, name, shapes, shapes[0], args)
                report(key, all_results[key])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(json.dumps(all_results, indent=1))
    print(args.out / "transfer.json")
    try:
        draw(all_results, args.out / "transfer.png")
        print(args.out / "transfer.png")
    except ImportError:
        print("no figure: the plots extra (matplotlib) is not installed")
    for name, results in all_results.items():
        report(name, results)


if __name__ == "__main__":
    main()
