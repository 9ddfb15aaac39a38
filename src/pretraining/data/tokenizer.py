"""Tokenizers: raw bytes or a byte-level BPE trained offline, both with the special tokens at fixed ids, which
the masked-LM and contrastive objectives rely on. A tokenizer names its own separators (`eos_id`, `bos_id`),
so a model's own (the hf extra's `ModelTokenizer`) packs documents as that model was trained to see them.
`token_bytes[i]`, the UTF-8 bytes token `i` stands for, gives bits per byte."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pretraining.errors import ConfigError, MissingFileError
from pretraining.files import regular_file, write_atomically

SPECIAL_TOKENS = ("<pad>", "<eos>", "<mask>", "<cls>")
PAD_ID, EOS_ID, MASK_ID, CLS_ID = range(len(SPECIAL_TOKENS))


class Tokenizer(Protocol):
    """What the data stream and the objectives need from a tokenizer."""

    vocab_size: int
    token_bytes: np.ndarray
    fingerprint: str
    eos_id: int  # ends every document in a packed block
    bos_id: int | None  # starts every document, where the tokenizer's model was trained so; None: nothing
    mask_id: int | None  # MASK_ID, or None for a tokenizer without the template's layout (no masked-LM)
    cls_id: int | None  # CLS_ID, or None likewise (no contrastive pairs)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class TemplateLayout:
    """The special tokens at the template's fixed ids, as both of its own tokenizers have them."""

    eos_id: int = EOS_ID
    bos_id: int | None = None
    mask_id: int | None = MASK_ID
    cls_id: int | None = CLS_ID


class ByteTokenizer(TemplateLayout):
    """UTF-8 bytes shifted past the special tokens: vocabulary 256 + specials."""

    def __init__(self) -> None:
        offset = len(SPECIAL_TOKENS)
        self._offset = offset
        self.vocab_size = 256 + offset
        self.token_bytes = np.array([0] * offset + [1] * 256, dtype=np.int64)
        self.fingerprint = hashlib.sha256(f"bytes/v1:{','.join(SPECIAL_TOKENS)}".encode()).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return [byte + self._offset for byte in text.encode()]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i - self._offset for i in ids if i >= self._offset).decode(errors="replace")


class BPETokenizer(TemplateLayout):
    """A byte-level BPE `tokenizer.json` from `train_bpe` (the `tokenizers` library)."""

    def __init__(self, path: str | Path) -> None:
        path = regular_file(Path(path), "tokenizer file", "name a tokenizer.json, or use tokenizer=bytes")
        if not path.is_file():
            raise MissingFileError(
                f"tokenizer file {path} not found: train one with "
                f"`pretrain-data tokenizer --data <shard dir> --out {path}`, or use tokenizer=bytes"
            )
        data = path.read_bytes()  # read once: the tokenizer, its export and its fingerprint are the same bytes
        self.json_text = data.decode(errors="replace")
        self._tokenizer = parse_tokenizer_json(
            self.json_text, path, "restore it, or train one with `pretrain-data tokenizer`"
        )
        # A literal "<eos>" in a document is text, not a separator.
        self._tokenizer.encode_special_tokens = True
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            if self._tokenizer.token_to_id(token) != expected_id:
                raise ConfigError(
                    f"{path}: special token {token} must have id {expected_id}; "
                    "retrain it with `pretrain-data tokenizer`"
                )
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.token_bytes = _byte_level_lengths(self._tokenizer.get_vocab(), self.vocab_size)
        self.fingerprint = hashlib.sha256(data).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))


def parse_tokenizer_json(text: str, source: Path, fix: str) -> Any:
    """A `tokenizers.Tokenizer` from the text of a tokenizer.json, refused naming `source` and `fix`."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return HFTokenizer.from_str(text)
    except Exception as error:  # the library's parse errors have no common type
        raise ConfigError(f"{source} is not a tokenizer.json the `tokenizers` library reads ({error}): {fix}") from None


def _byte_level_lengths(vocab: dict[str, int], vocab_size: int) -> np.ndarray:
    """In byte-level BPE each character of a token string stands for one byte."""
    lengths = np.zeros(vocab_size, dtype=np.int64)
    for token, index in vocab.items():
        if token not in SPECIAL_TOKENS:
            lengths[index] = len(token)
    return lengths


def train_bpe(
    texts: Iterable[str], vocab_size: int, out_path: Path, show_progress: bool = False, length: int | None = None
) -> BPETokenizer:
    """Train a byte-level BPE with the fixed special tokens and write `out_path` atomically (`show_progress`:
    on a terminal, of `length` texts)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size={vocab_size} must exceed 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Without the full byte alphabet, bytes unseen in training could not be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress and sys.stderr.isatty(),  # off a terminal it prints only blank lines
    )
    tokenizer.train_from_iterator(texts, trainer, length=length)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out_path, tokenizer.to_str().encode())
    return BPETokenizer(out_path)
