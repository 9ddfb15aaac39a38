"""Does document-aware attention help, and what does it cost? clm_tiny trained for the same steps on the same
data and seed three times: plain, masked (`model.document_masking`: a position attends only within its own
document of a packed block) and masked_positions (`model.document_positions` as well: positions restart at
each document).

Prints:
- how many validation blocks hold more than one document (where masking can change anything at all);
- each model's bits per byte on the whole validation split, read as it was trained and read with document
  masking (the reading in which no document sees another: the fair comparison);
- the training step (forward, backward, AdamW) of the clm_tiny shape on real batches, with and without
  masking, interleaved in this process: the masked / plain ratio of the median step times.

Every model is trained by the real `pretrain` command with the default settings but `--steps` (600: the
clm_tiny run, about 4 minutes each on 2 CPU cores) and the seed, once per `--seeds` (several seeds show how
far the runs differ by chance alone).

    python scripts/bench/bench_documents.py --data data/stdlib [--steps 600] [--seeds 1234 1] \
        [--log-dir logs/bench_documents]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pretraining.evaluate import build_from_checkpoint
from pretraining.objectives.causal_lm import CausalLM
from pretraining.stored import load_checkpoint
from trained import pretrain

VARIANTS = {
    "plain": [],
    "masked": ["model.document_masking=true"],
    "masked_positions": ["model.document_masking=true", "model.document_positions=true"],
}
ALL_BLOCKS = 10**9  # data.val_size: every validation block


@torch.no_grad()
def validation_bpb(model: CausalLM, batches: list[dict[str, torch.Tensor]], masking: bool) -> float:
    """Bits per byte over `batches`, reading documents with masking or without (positions as trained)."""
    model.eval()
    trained_masking, model.document_masking = model.document_masking, masking
    nll = text_bytes = 0.0
    for batch in batches:
        nll += float(model.token_nll(batch, "sum"))
        text_bytes += float(batch["target_bytes"].sum())
    model.document_masking = trained_masking
    return nll / (torch.log(torch.tensor(2.0)).item() * text_bytes)


def step_times(model: CausalLM, batches: list[dict[str, torch.Tensor]], repeats: int) -> dict[bool, float]:
    """Median seconds of a training step with masking off and on, interleaved so that both see the same
    machine load."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(repeats):
        for masking in (False, True):
            model.document_masking = masking
            batch = batches[step % len(batches)]
            start = time.perf_counter()
            model.training_loss(batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times[masking].append(time.perf_counter() - start)
    return {masking: statistics.median(seconds[repeats // 10 :]) for masking, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="the shards (make data: data/stdlib)")
    parser.add_argument("--steps", type=int, default=600, help="training steps of each model")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234], help="each model's seeds (train.yaml's: 1234)")
    parser.add_argument("--timed-steps", type=int, default=200, help="training steps timed with and without masking")
    parser.add_argument("--log-dir", type=Path, default=Path("logs/bench_documents"))
    args = parser.parse_args()
    log_dir = args.log_dir.resolve()
    models = {}
    for seed in args.seeds:
        for name, overrides in VARIANTS.items():
            run = f"{name}-seed{seed}"
            path = pretrain(log_dir, run, args.steps, args.data, "experiment=clm_tiny", f"seed={seed}", *overrides)
            model, datamodule = build_from_checkpoint(load_checkpoint(path), str(path), {"val_size": ALL_BLOCKS})
            assert isinstance(model, CausalLM)
            models[run] = model
    datamodule.setup("validate")
    batches = list(datamodule.val_dataloader())
    blocks = sum(len(batch["tokens"]) for batch in batches)
    crossing = sum(int((batch["doc_ids"][:, -1] > 0).sum()) for batch in batches)
    print(f"\nvalidation: {blocks} blocks, {crossing} ({crossing / blocks:.1%}) with more than one document")
    print(f"bits per byte on the whole validation split after {args.steps} steps:")
    print(f"  {'model':<24} {'as trained':>10} {'masked':>10}")
    for run, model in models.items():
        as_trained = validation_bpb(model, batches, model.document_masking)
        print(f"  {run:<24} {as_trained:>10.4f} {validation_bpb(model, batches, True):>10.4f}")

    datamodule.setup("fit")
    loader = iter(datamodule.train_dataloader())
    train_batches = [next(loader) for _ in range(20)]
    seconds = step_times(next(iter(models.values())), train_batches, args.timed_steps)
    print(
        f"training step of clm_tiny ({args.timed_steps} interleaved, median): plain {seconds[False] * 1e3:.2f} ms, "
        f"masked {seconds[True] * 1e3:.2f} ms, masked / plain {seconds[True] / seconds[False]:.3f}"
    )


if __name__ == "__main__":
    main()
