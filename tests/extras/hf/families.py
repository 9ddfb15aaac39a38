"""Tokenizers with the special-token layouts of the open model families, trained in the test with `tokenizers`
and saved as their Hugging Face directories are: GPT-2 (byte-level BPE, `<|endoftext|>` last, named only in
config.json), Llama 3 (byte-level, `<|begin_of_text|>` added in front by the post-processor), Qwen (byte-level,
`<|endoftext|>` as EOS and no BOS, more embedding rows than ids) and Llama 2 / Mistral (SentencePiece BPE with
byte fallback, `<s>` `</s>`, `add_bos_token`)."""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# Text to train on: the standard library's own source, as the default corpus is.
CORPUS = [inspect.getsource(module) for module in (json, textwrap, inspect)]
# family: the tokenizer class its directories name (transformers 5 builds that class's pipeline around the
# file's vocabulary), its special tokens (after the learned ones), tokenizer_config.json, the ids config.json names
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {
        "class": "GPT2Tokenizer",
        "specials": ["<|endoftext|>"],
        "config": {},
        "ids": ["bos_token_id", "eos_token_id"],
    },
    "llama3": {
        "class": "PreTrainedTokenizerFast",
        "specials": ["<|begin_of_text|>", "<|end_of_text|>"],
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        "ids": [],
    },
    "qwen": {
        "class": "Qwen2Tokenizer",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "config": {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
        "ids": [],
    },
    "llama2": {
        "class": "LlamaTokenizer",
        "specials": ["<unk>", "<s>", "</s>"],
        "config": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": False},
        "ids": [],
    },
}


# Qwen2's split before the byte-level step (transformers' tokenization_qwen2.py), and its NFC normalizer.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def byte_level(specials: list[str], vocab_size: int, qwen: bool = False) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen:
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def sentencepiece(specials: list[str], vocab_size: int) -> Tokenizer:
    """Llama 2's layout: the specials first, then a BPE over `▁`-joined words that falls back to bytes."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*specials, *byte_tokens])
    tokenizer.train_from_iterator(CORPUS, trainer)
    saved = json.loads(tokenizer.to_str())  # the byte tokens stay in the vocabulary, not special: as Llama 2's
    saved["added_tokens"] = [token for token in saved["added_tokens"] if token["content"] in specials]
    return Tokenizer.from_str(json.dumps(saved))


def family_tokenizer(family: str, directory: Path, vocab_size: int = 400, rows: int | None = None) -> Path:
    """Write `family`'s tokenizer files into `directory` (and a config.json of `rows` embedding rows, where
    given); return the directory."""
    layout = FAMILIES[family]
    if family == "llama2":
        tokenizer = sentencepiece(layout["specials"], vocab_size)
    else:
        tokenizer = byte_level(layout["specials"], vocab_size, qwen=family == "qwen")
    if family == "llama3":
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": layout["class"], **layout["config"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ids = {key: tokenizer.token_to_id("<|endoftext|>") for key in layout["ids"]}
    model_config = {**ids, **({"vocab_size": rows} if rows else {})}
    if model_config:
        (directory / "config.json").write_text(json.dumps(model_config))
    return directory
