"""What does a Muon step cost against an AdamW step, and what does orthogonalising in float32 instead of
bfloat16 change on this machine? clm_tiny's model (4 layers of width 128: 16 hidden matrices) with one
backward's gradients; each optimizer steps `--steps` times after one untimed step. Prints the median step
time of AdamW, of MuonAdamW orthogonalising in float32 (what it does off CUDA) and in bfloat16 (torch.optim.Muon's
choice, what it does on CUDA).

    python scripts/bench/bench_muon.py [--steps 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import torch

from pretraining.models.transformer import Transformer
from pretraining.objectives import optimizers
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.optimizers import MuonAdamW


def model_with_gradients() -> CausalLM:
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=256, max_seq_len=256, d_model=128, n_layer=4, n_head=4, causal=True)
    model = CausalLM(backbone, optimizer=partial(torch.optim.AdamW))
    model.training_loss({"tokens": torch.randint(0, 256, (8, 257))}).backward()
    return model


def median_step_seconds(factory: Callable[..., torch.optim.Optimizer], steps: int) -> float:
    model = model_with_gradients()
    model.optimizer_factory = factory
    # configure_optimizers reads only these of the trainer
    model.trainer = SimpleNamespace(max_steps=1000, precision_plugin=None, gradient_clip_val=1.0)
    optimizer = model.configure_optimizers()["optimizer"]
    model.trainer = None
    optimizer.step()  # lazy state initialisation, outside the timing
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{torch.__version__}, {args.threads} threads")
    print(f"AdamW:                    {median_step_seconds(partial(torch.optim.AdamW), args.steps) * 1e3:8.1f} ms")
    for dtype in (torch.float32, torch.bfloat16):
        optimizers.orthogonalisation_dtype = lambda device, dtype=dtype: dtype  # as on CUDA, for bfloat16
        seconds = median_step_seconds(partial(MuonAdamW), args.steps)
        print(f"MuonAdamW, NS in {str(dtype).removeprefix('torch.'):9s}{seconds * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
