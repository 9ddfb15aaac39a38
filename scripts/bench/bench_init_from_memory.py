"""Peak memory of `callbacks.init_from_hf` loading a ~1B-parameter Llama from a sharded safetensors directory, as a
ratio to the model's float32 size and to building the backbone alone, measured in this run.

    python scripts/bench/bench_init_from_memory.py [--dir DIR] [--layers 16] [--shard-size 500MB]

A randomly initialised `LlamaForCausalLM` (hidden 2048, 16 layers of 16 heads, MLP 5632, vocabulary 32000, an
untied head: 0.95B parameters) is saved by `save_pretrained` in shards; then each way of loading runs in a fresh
process, which prints its peak resident memory (`ru_maxrss`):

- `build`: the backbone alone, the baseline (the model once, and Python, torch and the template);
- `stream`: the backbone, then `checked_loader` with `StoredTensors` (tensor by tensor into the parameters);
- `state-dict`: the backbone, then every tensor read into one dict and `load_state_dict` (the loader before it).

The directory is written once and reused (`--dir`); it needs about 4.5 GB of disk.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

WAYS = ("build", "stream", "state-dict")


def sizes(layers: int) -> dict[str, int]:
    return {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 32000,
    }


def save_model(directory: Path, layers: int, shard_size: str) -> None:
    """A random Llama of `sizes`, saved in shards of `shard_size` (skipped where `directory` holds one)."""
    if (directory / "model.safetensors.index.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**sizes(layers), tie_word_embeddings=False, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size=shard_size)


def load(directory: Path, way: str) -> dict[str, float]:
    """In this process: build the backbone, load the directory `way`; the peak memory and the seconds taken."""
    import torch
    from safetensors.torch import load_file

    from pretraining.extras.hf.directory import StoredTensors, weight_files
    from pretraining.extras.hf.init_from import checked_loader
    from pretraining.models.llama import Llama

    config = json.loads((directory / "config.json").read_text())
    backbone = Llama(
        vocab_size=config["vocab_size"],
        max_seq_len=2048,
        d_model=config["hidden_size"],
        n_layer=config["num_hidden_layers"],
        n_head=config["num_attention_heads"],
        mlp_width=config["intermediate_size"],
        tie_head=False,
        norm_eps=config["rms_norm_eps"],
    )
    parameters = sum(parameter.numel() for parameter in backbone.parameters())
    start = time.perf_counter()
    if way == "stream":
        checked_loader(config, backbone, config["vocab_size"], str(directory))(StoredTensors(weight_files(directory)))
    elif way == "state-dict":
        weights: dict[str, torch.Tensor] = {}
        for path in weight_files(directory):
            weights.update(load_file(path))
        backbone.load_state_dict({name.removeprefix("model."): tensor for name, tensor in weights.items()})
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"parameters": parameters, "peak": peak, "seconds": took}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("logs/bench_init_from_memory"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--shard-size", default="500MB")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one measurement, in a child process
    args = parser.parse_args()
    if args.way:
        print(json.dumps(load(args.dir, args.way)))
        return
    save_model(args.dir, args.layers, args.shard_size)
    shards = len(list(args.dir.glob("*.safetensors")))
    results = {}
    for way in WAYS:
        command = [sys.executable, __file__, "--dir", str(args.dir), "--way", way]
        results[way] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    parameters = results["build"]["parameters"]
    model = 4 * parameters
    baseline = results["build"]["peak"]
    print(f"{parameters / 1e9:.2f}B parameters, {model / 2**30:.2f} GiB in float32, {shards} safetensors shards\n")
    print(f"{'way':<12} {'peak GiB':>9} {'over build GiB':>15} {'/ float32 model':>16} {'/ build':>8} {'seconds':>8}")
    for way, result in results.items():
        peak = result["peak"]
        print(
            f"{way:<12} {peak / 2**30:>9.2f} {(peak - baseline) / 2**30:>15.2f} {peak / model:>16.2f} "
            f"{peak / baseline:>8.2f} {result['seconds']:>8.1f}"
        )


if __name__ == "__main__":
    main()
