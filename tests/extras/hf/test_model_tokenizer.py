"""`tokenizer=hf`: a model directory's own tokenizer gives the ids `transformers` gives, takes its BOS/EOS
from the files beside it as `transformers` does, packs documents as that family was trained to see them, and
refuses what it cannot read in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf.families import FAMILIES, family_tokenizer
from transformers import AutoTokenizer

from pretraining.data.formats import encode_document
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.model_tokenizer import ModelTokenizer

TEXT = 'def add(a, b):\n    """Sum. <|endoftext|> stays text"""\n    return a + b  # naïve ☃'
# family: (the BOS a document starts with, the EOS it ends with)
SEPARATORS = {
    "gpt2": (None, "<|endoftext|>"),
    "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
    "qwen": (None, "<|endoftext|>"),
    "llama2": ("<s>", "</s>"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_and_separators_are_the_models(tmp_path: Path, family: str) -> None:
    directory = family_tokenizer(family, tmp_path / family)
    ours, theirs = ModelTokenizer(directory), AutoTokenizer.from_pretrained(directory, split_special_tokens=True)
    assert ours.encode(TEXT) == theirs(TEXT, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(TEXT)) == TEXT
    bos, eos = SEPARATORS[family]
    document = encode_document(ours, TEXT)
    assert document[-1] == theirs.convert_tokens_to_ids(eos) == ours.eos_id
    assert document[0] == (theirs.convert_tokens_to_ids(bos) if bos else ours.encode(TEXT)[0])
    assert len(document) == len(ours.encode(TEXT)) + 1 + (bos is not None)
    # bits per byte count each id's bytes: a text's ids add up to its UTF-8 length
    assert ours.token_bytes[ours.encode(TEXT)].sum() == len(TEXT.encode()) + (family == "llama2")  # its "▁" start
    assert ours.token_bytes[ours.eos_id] == 0
    assert ours.mask_id is None and ours.cls_id is None


def test_vocabulary_is_the_models_rows(tmp_path: Path) -> None:
    """Qwen's embedding has more rows than its tokenizer has ids: the run's vocabulary is the model's."""
    tokenizer = ModelTokenizer(family_tokenizer("qwen", tmp_path / "qwen", rows=448))
    assert tokenizer.vocab_size == 448 and len(tokenizer.token_bytes) == 448
    with pytest.raises(ConfigError, match=r"vocab_size=300, fewer rows than the 40\d ids"):
        ModelTokenizer(family_tokenizer("qwen", tmp_path / "small", rows=300))


def test_fingerprint_follows_the_separators(tmp_path: Path) -> None:
    directory = family_tokenizer("llama2", tmp_path / "llama2")
    before = ModelTokenizer(directory).fingerprint
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    changed = ModelTokenizer(directory)
    assert changed.bos_id is None and changed.fingerprint != before


def test_refusals_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match=r"has no tokenizer\.json"):
        ModelTokenizer(tmp_path)
    directory = family_tokenizer("llama3", tmp_path / "llama3")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    with pytest.raises(ConfigError, match="auto_map: this tokenizer needs code"):
        ModelTokenizer(directory)
    config_path.write_text(json.dumps({**config, "eos_token": "<|eot|>"}))
    with pytest.raises(ConfigError, match=re.escape("eos_token '<|eot|>', which its tokenizer.json does not have")):
        ModelTokenizer(directory)
    config_path.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ConfigError, match="names no EOS token"):
        ModelTokenizer(directory)
