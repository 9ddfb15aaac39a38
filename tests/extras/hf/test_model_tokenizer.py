"""`tokenizer=hf`: a model directory's own tokenizer gives the ids `transformers` gives, takes its BOS/EOS
from the files beside it as `transformers` does, packs documents as that family was trained to see them, and
refuses what it cannot read in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf.families import FAMILIES, family_tokenizer
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer

from pretraining.data.formats import encode_document
from pretraining.data.pair_format import TokenizedPairs
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.model_tokenizer import ModelTokenizer
from pretraining.extras.hf.tokenizer import check_same_tokenizer

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


def test_the_bos_is_the_token_the_post_processor_puts_in_front(tmp_path: Path) -> None:
    """A post-processor adding BOS and EOS around a text (`<s> $A </s>`) starts each document with its BOS, the
    token the model saw, whatever the files name; `add_bos_token: true` naming no BOS is refused."""
    directory = family_tokenizer("llama3", tmp_path / "llama3")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(token, tokenizer.token_to_id(token)) for token in (bos, eos)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))  # no bos_token named
    assert ModelTokenizer(directory).bos_id == tokenizer.token_to_id(bos)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "add_bos_token": False}))
    assert ModelTokenizer(directory).bos_id is None
    tokenizer.post_processor = None
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "add_bos_token": True}))
    with pytest.raises(ConfigError, match="has add_bos_token: true and names no bos_token"):
        ModelTokenizer(directory)


def test_special_tokens_map_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """An older directory (no added_tokens_decoder in tokenizer_config.json): special_tokens_map.json wins."""
    directory = family_tokenizer("qwen", tmp_path / "qwen")
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    theirs = AutoTokenizer.from_pretrained(directory)
    assert ModelTokenizer(directory).eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    current = {**config, "added_tokens_decoder": {}}  # a key transformers 4.34 and later write: the map is not read
    (directory / "tokenizer_config.json").write_text(json.dumps(current))
    theirs = AutoTokenizer.from_pretrained(directory)
    assert ModelTokenizer(directory).eos_id == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|endoftext|>")


def test_a_directory_with_other_added_tokens_tokenizes_differently(tmp_path: Path) -> None:
    """Added tokens are matched in a text before the vocabulary: init_from's check compares them too."""
    run = ModelTokenizer(family_tokenizer("qwen", tmp_path / "run"))
    other = family_tokenizer("qwen", tmp_path / "other")
    tokenizer = Tokenizer.from_file(str(other / "tokenizer.json"))
    tokenizer.add_tokens(["<think>"])
    tokenizer.save(str(other / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"tokenizes differently .* it adds 4 tokens to its vocabulary, the run's 3"):
        check_same_tokenizer(other / "tokenizer.json", run, "fix")
    check_same_tokenizer(tmp_path / "run" / "tokenizer.json", run, "fix")


def test_contrastive_pairs_need_the_templates_cls(tmp_path: Path) -> None:
    tokenizer = ModelTokenizer(family_tokenizer("gpt2", tmp_path / "gpt2"))
    with pytest.raises(ConfigError, match=r"start each side with the template's <cls> \(id 3\), and ModelTokenizer"):
        TokenizedPairs(tokenizer, query_len=16, passage_len=32)
