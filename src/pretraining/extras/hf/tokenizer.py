"""The run's tokenizer as a Hugging Face `tokenizer.json` (`PreTrainedTokenizerFast`), and the check
that a model directory's tokenizer is the run's.

The byte tokenizer becomes a byte-level BPE without merges: each UTF-8 byte is one token, at the same
id (256 bytes after the special tokens), so `tokenizer(text)` gives the template's ids. A BPE is its
own `tokenizer.json`, and so is a model directory's (`ModelTokenizer`, `tokenizer=hf`). Contrastive exports add
the CLS token in front, as the template's pairs do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pretraining.data.tokenizer import (
    CLS_ID,
    SPECIAL_TOKENS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    parse_tokenizer_json,
)
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.model_tokenizer import ModelTokenizer

PAD, EOS, MASK, CLS = SPECIAL_TOKENS  # the roles an export's tokenizer_config.json names
# What decides how text becomes ids: equal sections, equal ids.
TOKENIZING_SECTIONS = ("model", "normalizer", "pre_tokenizer", "added_tokens")


def hf_tokenizer(tokenizer: Tokenizer) -> HFTokenizer:
    """The `tokenizers` object with `tokenizer`'s vocabulary and splitting. It reads a special-token string
    in a text as that token unless told not to (`encode_special_tokens`, which its JSON does not keep:
    `transformers` sets it from `split_special_tokens` in tokenizer_config.json)."""
    if isinstance(tokenizer, BPETokenizer | ModelTokenizer):
        loaded = HFTokenizer.from_str(tokenizer.json_text)  # parsed when the run's tokenizer was built
        loaded.post_processor = None  # the template encodes without one (add_special_tokens=False)
        return loaded
    if isinstance(tokenizer, ByteTokenizer):
        return byte_level_without_merges()
    raise ConfigError(
        f"{type(tokenizer).__name__} has no Hugging Face form: export supports tokenizer=bytes, bpe and hf"
    )


def byte_level_without_merges() -> HFTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda char: BYTE_OF[char])
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's), to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(byte for byte in range(256) if byte not in stand_ins):
        stand_ins[byte] = chr(256 + extra)
    return {char: byte for byte, char in stand_ins.items()}


BYTE_OF = gpt2_byte_alphabet()


def tokenizer_files(
    tokenizer: Tokenizer, special: dict[str, str], max_length: int, cls_first: bool = False, marks_in_text: bool = False
) -> dict[str, bytes]:
    """`tokenizer.json` and `tokenizer_config.json` of `tokenizer` for an export: `special` names the
    roles of the special tokens (`eos_token: <eos>`, ...); `cls_first` puts CLS before every text;
    `marks_in_text` reads a special token written in a text as that token (`<mask>`, for a masked-LM),
    where the template reads it as text."""
    exported = hf_tokenizer(tokenizer)
    if cls_first:
        exported.post_processor = processors.TemplateProcessing(
            single=f"{CLS} $A", pair=f"{CLS} $A $B", special_tokens=[(CLS, CLS_ID)]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "split_special_tokens": not marks_in_text,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": exported.to_str(pretty=True).encode(),
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
    }


def check_same_tokenizer(path: Path, tokenizer: Tokenizer, fix: str) -> None:
    """Refuse a `tokenizer.json` at `path` that would not give the ids `tokenizer` gives, naming what differs."""
    if not path.is_file():
        raise MissingFileError(f"{path} not found: without it nothing says the model reads the run's tokens; {fix}")
    theirs = json.loads(parse_tokenizer_json(path.read_text(errors="replace"), path, "restore it").to_str())
    ours = json.loads(hf_tokenizer(tokenizer).to_str())
    for section in TOKENIZING_SECTIONS:
        if theirs.get(section) != ours.get(section):
            raise ConfigError(
                f"{path} tokenizes differently from the run's tokenizer: {difference(section, theirs, ours)}; {fix}"
            )


def difference(section: str, theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    if section == "added_tokens":  # matched in a text before the model's vocabulary, at ids of their own
        their_tokens, our_tokens = theirs.get(section) or [], ours.get(section) or []
        first = next((a for a, b in zip(their_tokens, our_tokens, strict=False) if a != b), None)
        if first is None:
            return f"it adds {len(their_tokens)} tokens to its vocabulary, the run's {len(our_tokens)}"
        return f"its added token {first.get('content')!r} (id {first.get('id')}) is not the run's"
    if section != "model":
        return f"its {section.replace('_', '-')} is {theirs.get(section)}, the run's {ours.get(section)}"
    their_vocab, our_vocab = theirs["model"].get("vocab") or {}, ours["model"].get("vocab") or {}
    if their_vocab != our_vocab:
        return f"its vocabulary has {len(their_vocab)} tokens, the run's {len(our_vocab)}" + (
            " (the same number, other tokens or ids)" if len(their_vocab) == len(our_vocab) else ""
        )
    return "the same vocabulary but other merges (or another model type)"
