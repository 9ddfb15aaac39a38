"""Continued pretraining of an open model's directory, measured in `transformers` before and after.

    .venv/bin/python scripts/bench/bench_continue.py [--data data/stdlib] [--steps 200] [--out /tmp/bench_continue]

A Qwen3-shaped model (`Qwen3ForCausalLM`, QK-norm, grouped-query attention, tied head) with a Qwen-layout
tokenizer (byte-level BPE, `<|endoftext|>` as EOS, no BOS, more embedding rows than ids) is written as
`save_pretrained` writes a hub model; the tokenizer is trained on the data's training split, the weights
are random (nothing is downloaded). `pretrain` continues it for `--steps` steps with its own tokenizer and
weights (`tokenizer=hf`, `callbacks.init_from_hf`), `pretrain-export` writes it back, and `transformers` alone
scores the directory before and the export after on the data's validation blocks, as the template packs
them. Prints the two losses, the template's own `val/loss` at step 0 and at the end beside them (the same
blocks: they agree with `transformers` where the weights are the same), and the wall time.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, Qwen3Config

from pretraining.config import CONFIG_DIR
from pretraining.data.commands import train_texts
from pretraining.data.manifest import Manifest
from pretraining.extras.hf.export import export
from pretraining.instantiate import build
from trained import pretrain

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's, after the learned tokens
SHAPE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4}
BACKBONE = [
    "model/backbone=llama",
    "model.backbone.d_model=128",
    "model.backbone.mlp_width=384",
    "model.backbone.n_layer=4",
    "model.backbone.n_head=4",
    "model.backbone.n_kv_head=2",
    "model.backbone.qk_norm=true",
    "model.backbone.rope_theta=1000000.0",
    "model.backbone.norm_eps=1e-6",
]


def qwen_directory(data: Path, out: Path, vocab_size: int) -> Path:
    """A Qwen3-shaped model with random weights and a Qwen-layout tokenizer trained on `data`'s training split."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(train_texts(Manifest.load(data)), trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    out.mkdir(parents=True)
    tokenizer.save(str(out / "tokenizer.json"))
    layout = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": SPECIALS[0],
        "pad_token": SPECIALS[0],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(layout))
    rows = -(-tokenizer.get_vocab_size() // 64) * 64
    config = Qwen3Config(
        **SHAPE, num_key_value_heads=2, head_dim=32, vocab_size=rows, rope_theta=1e6, tie_word_embeddings=True
    )
    config.eos_token_id = config.pad_token_id = tokenizer.token_to_id(SPECIALS[0])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def validation_loss(directory: Path, overrides: list[str]) -> float:
    """The mean next-token loss of `directory`'s model, in `transformers`, on the validation blocks of the run
    that `overrides` compose (its data, packed by its tokenizer)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    datamodule = build(cfg.data, tokenizer=build(cfg.tokenizer))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in datamodule.val_dataloader():
            tokens = batch["tokens"]
            logits = model(tokens[:, :-1]).logits
            total += F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").item()
            count += tokens[:, 1:].numel()
    return total / count


def logged_losses(run: Path) -> dict[int, float]:
    """`val/loss` by step, from the run's CSV log."""
    with (run / "csv" / "metrics.csv").open() as file:
        return {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(file) if row.get("val/loss")}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/stdlib"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_continue"))
    args = parser.parse_args(argv)
    directory = qwen_directory(args.data, args.out / "qwen3", args.vocab_size)
    overrides = [
        "experiment=clm_modern",
        *BACKBONE,
        "tokenizer=hf",
        f"tokenizer.path={directory}",
        "callbacks=[default,init_from_hf]",
        f"callbacks.init_from_hf.path={directory}",
        f"model.decay_steps={args.steps // 5}",
    ]
    before = validation_loss(directory, [*overrides, f"data.dir={args.data}"])
    start = time.perf_counter()
    checkpoint = pretrain(args.out / "logs", "continued", args.steps, args.data, *overrides)
    seconds = time.perf_counter() - start
    export(checkpoint, args.out / "export")
    after = validation_loss(args.out / "export", [*overrides, f"data.dir={args.data}"])
    logged = logged_losses(args.out / "logs" / "train" / "runs" / "continued")
    print("| | validation loss in transformers | the run's val/loss |\n|---|---|---|")
    print(f"| before (the directory, step 0) | {before:.4f} | {logged[min(logged)]:.4f} |")
    print(f"| after {args.steps} steps (the export) | {after:.4f} | {logged[max(logged)]:.4f} |")
    print(f"\n{args.steps} steps in {seconds:.0f} s (the whole `pretrain` process)")


if __name__ == "__main__":
    main()
