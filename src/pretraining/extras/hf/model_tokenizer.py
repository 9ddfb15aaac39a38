"""`tokenizer=hf tokenizer.path=DIR`: a Hugging Face model's own tokenizer as the run's, for continued
pretraining of that model (GPT-2, Llama 2/3, Qwen2/3, Mistral, SmolLM; `callbacks.init_from_hf`).

It reads the directory's `tokenizer.json` as it is, with the `tokenizers` library (transformers 5 builds a
named class's pipeline, `Qwen2Tokenizer`'s, `LlamaTokenizer`'s, around the file's vocabulary: the hub's
files hold that same pipeline), and its special tokens from the files beside it as `transformers` reads
them (`special_id`), then the ids in `generation_config.json` and `config.json` (a tokenizer class's own
default EOS is not read). Documents are packed as the model was trained to see them: its BOS first where
its tokenizer puts one in front (Llama's), its EOS after each (GPT-2's and Qwen's `<|endoftext|>`). A
special token's text inside a document stays text, as with the template's tokenizers. Nothing in the
directory runs: a tokenizer that needs its own code (`auto_map`) is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from pretraining.data.tokenizer import parse_tokenizer_json
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.directory import read_json

KEY = "tokenizer.path"
# The files that make the tokenizer, and the generation settings that name its ids: copied as they are into
# the export of a run that read them.
TOKENIZER_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# Where each role's token is named: token strings (in the order `special_id` says), then ids.
TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")
ID_FILES = ("generation_config.json", "config.json")
BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's token for one raw byte


class ModelTokenizer:
    """The tokenizer of the model directory `path`. `vocab_size` is the model's embedding rows where its
    `config.json` says them (Qwen's exceed its tokenizer's ids), else the tokenizer's."""

    mask_id: int | None = None  # masked-LM and contrastive pairs need the template's layout
    cls_id: int | None = None

    def __init__(self, path: str | Path) -> None:
        directory = Path(path)
        if not (directory / "tokenizer.json").is_file():
            raise MissingFileError(
                f"{KEY}={path} has no tokenizer.json: name a Hugging Face model directory (from "
                "`huggingface-cli download`); one with only a slow tokenizer converts with transformers: "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
            )
        self.files = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
        settings = {name: read_object(directory / name) for name in (*TOKEN_FILES, *ID_FILES)}
        if "auto_map" in settings["tokenizer_config.json"]:
            raise ConfigError(
                f"{directory / 'tokenizer_config.json'} has auto_map: this tokenizer needs code of its own, which "
                "the template never runs; use a model whose tokenizer.json loads as PreTrainedTokenizerFast"
            )
        self._tokenizer = parse_tokenizer_json(self.json_text, directory / "tokenizer.json", "restore it")
        self._tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a document is text
        self.eos_id = self.special_id("eos", settings, directory)
        if self.eos_id is None:
            raise ConfigError(
                f"{directory} names no EOS token (eos_token in tokenizer_config.json, or eos_token_id): packed "
                "documents need one between them; add it to tokenizer_config.json"
            )
        self.bos_id = self.bos(settings, directory)
        ids = self._tokenizer.get_vocab_size(with_added_tokens=True)
        rows = settings["config.json"].get("vocab_size")
        if isinstance(rows, int) and rows < ids:
            raise ConfigError(
                f"{directory / 'config.json'} has vocab_size={rows}, fewer rows than the {ids} ids of its "
                "tokenizer.json: the tokenizer is not this model's; restore the model's own tokenizer files"
            )
        self.vocab_size = rows if isinstance(rows, int) else ids
        self.token_bytes = token_lengths(self._tokenizer, self.vocab_size)
        identity = [self.files["tokenizer.json"], f"{self.eos_id},{self.bos_id},{self.vocab_size}".encode()]
        self.fingerprint = hashlib.sha256(b"\0".join(identity)).hexdigest()[:16]

    def bos(self, settings: dict[str, dict[str, Any]], directory: Path) -> int | None:
        """The BOS each document starts with: the token the post-processor puts in front of a text, or where
        tokenizer_config.json says `add_bos_token` (transformers' Llama tokenizers set their post-processor by
        it), the token it names; None where the model saw none."""
        said = settings["tokenizer_config.json"].get("add_bos_token")
        front = leading_tokens(self._tokenizer)
        if said is False or (said is None and not front):
            return None
        named = self.special_id("bos", settings, directory)
        if said is None and named != front[0]:
            named = front[0]  # the token the model saw, whatever the files call it
        if named is None:
            raise ConfigError(
                f"{directory / 'tokenizer_config.json'} has add_bos_token: true and names no bos_token: the "
                "documents' first token is unknown; add bos_token to it"
            )
        return named

    def special_id(self, role: str, settings: dict[str, dict[str, Any]], directory: Path) -> int | None:
        """The id of the `role` token (eos, bos): its string where the token files name one, else an id. As
        transformers 5 reads them, special_tokens_map.json wins where tokenizer_config.json has no
        `added_tokens_decoder` (an older directory's), and is not read where it has."""
        current = "added_tokens_decoder" in settings["tokenizer_config.json"]
        for name in TOKEN_FILES[:1] if current else TOKEN_FILES[::-1]:
            token = settings[name].get(f"{role}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                found = self._tokenizer.token_to_id(token)
                if found is None:
                    raise ConfigError(
                        f"{directory / name} names {role}_token {token!r}, which its tokenizer.json does not have: "
                        "restore the model's own tokenizer files"
                    )
                return int(found)
        for name in ID_FILES:
            found = settings[name].get(f"{role}_token_id")
            found = found[0] if isinstance(found, list) and found else found  # Llama 3 instruct lists several
            if isinstance(found, int):
                return found
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        return self._tokenizer.decode(list(ids))

    @property
    def json_text(self) -> str:
        """The tokenizer.json it reads, for the check that a model directory tokenizes alike."""
        return self.files["tokenizer.json"].decode(errors="replace")


def read_object(path: Path) -> dict[str, Any]:
    """A JSON object of the directory, or {} where the file is absent."""
    return read_json(path) if path.is_file() else {}


def leading_tokens(tokenizer: Any) -> list[int]:
    """The ids the post-processor puts before a text (Llama's BOS; none for GPT-2 and Qwen), whatever it adds
    after it."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    processed = tokenizer.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(processed) - len(plain) + 1) if processed[i : i + len(plain)] == plain]
    return processed[: starts[0]] if starts else []


def token_lengths(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """The UTF-8 bytes each id stands for (0 for special tokens and rows no token has): byte-level BPE writes
    each byte as one character; SentencePiece writes a space as `▁` and a raw byte as `<0xAB>`."""
    byte_level = "ByteLevel" in json.dumps(json.loads(tokenizer.to_str()).get("decoder"))
    added = {token.content: token.special for token in tokenizer.get_added_tokens_decoder().values()}
    lengths = np.zeros(vocab_size, dtype=np.int64)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if added.get(token) or index >= vocab_size:
            continue
        if token in added:  # an added token is matched as the text it is
            lengths[index] = len(token.encode())
        elif byte_level:
            lengths[index] = len(token)
        else:
            lengths[index] = 1 if BYTE_FALLBACK.fullmatch(token) else len(token.replace("▁", " ").encode())
    return lengths
