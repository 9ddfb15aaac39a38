"""Byte and BPE tokenizers: round trips, fixed special ids, byte counts, fingerprints, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from pretraining.cli import data as cli_main
from pretraining.data.corpus import read_source
from pretraining.data.manifest import Manifest
from pretraining.data.reader import read_shard
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import (
    CLS_ID,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    BPETokenizer,
    ByteTokenizer,
    train_bpe,
)

WORDS = ["def", "return", "self", "import", "value", "for", "in", "range", "print", "(", ")", ":", "=", "+"]
TEXTS = [
    "",
    "hello world",
    "plain ASCII with digits 0123456789 and punctuation !?.,;:'\"[]{}",
    "multi-byte: café naïve Ελληνικά русский 日本語 한국어",
    "emoji: 🙂🚀 family 👩‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "control\x00\x01\x7f tabs\tand\r\nnewlines\n",
    "  leading and trailing spaces  ",
]


def training_texts(count: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(10)) for _ in range(count)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[BPETokenizer, Path]:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return train_bpe(training_texts(), 320, path), path


@pytest.fixture(scope="module")
def bpe(trained) -> BPETokenizer:
    return trained[0]


def test_special_ids_are_fixed():
    assert (PAD_ID, EOS_ID, MASK_ID, CLS_ID) == (0, 1, 2, 3)
    assert SPECIAL_TOKENS == ("<pad>", "<eos>", "<mask>", "<cls>")


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode())
    assert all(len(SPECIAL_TOKENS) <= i < tokenizer.vocab_size for i in ids)
    assert int(tokenizer.token_bytes[ids].sum()) == len(text.encode())


def test_byte_tokenizer_vocabulary():
    tokenizer = ByteTokenizer()
    assert tokenizer.vocab_size == 260
    assert tokenizer.token_bytes.shape == (260,)
    assert tokenizer.token_bytes.tolist() == [0, 0, 0, 0] + [1] * 256
    assert tokenizer.encode("\x00\x7f") == [4, 0x7F + 4]
    assert tokenizer.encode("é") == [0xC3 + 4, 0xA9 + 4]
    # Special ids are not text: decoding drops them.
    assert tokenizer.decode([PAD_ID, *tokenizer.encode("ab"), EOS_ID, CLS_ID, MASK_ID]) == "ab"
    assert tokenizer.fingerprint == ByteTokenizer().fingerprint
    assert len(tokenizer.fingerprint) == 16


def test_byte_tokenizer_never_produces_special_ids_for_their_names():
    tokenizer = ByteTokenizer()
    text = "<pad><eos><mask><cls>"
    ids = tokenizer.encode(text)
    assert not set(ids) & {PAD_ID, EOS_ID, MASK_ID, CLS_ID}
    assert tokenizer.decode(ids) == text


def test_bpe_vocabulary_and_special_ids(trained):
    from tokenizers import Tokenizer as HFTokenizer

    bpe, path = trained
    assert 260 < bpe.vocab_size <= 320
    assert bpe.token_bytes.shape == (bpe.vocab_size,)
    raw = HFTokenizer.from_file(str(path))
    for expected, token in enumerate(SPECIAL_TOKENS):
        assert raw.token_to_id(token) == expected
    assert bpe.token_bytes[: len(SPECIAL_TOKENS)].tolist() == [0, 0, 0, 0]
    assert (bpe.token_bytes[len(SPECIAL_TOKENS) :] >= 1).all()
    # Learned merges stand for more than one byte.
    assert bpe.token_bytes.max() > 1


@pytest.mark.parametrize("text", [*TEXTS, training_texts(1, seed=7)[0]])
def test_bpe_round_trip_and_byte_counts(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(len(SPECIAL_TOKENS) <= i < bpe.vocab_size for i in ids)
    assert int(bpe.token_bytes[ids].sum()) == len(text.encode())


def test_bpe_compresses_text_like_its_training_data(bpe):
    text = training_texts(1, seed=7)[0]
    assert len(bpe.encode(text)) < len(text.encode()) / 2


def test_bpe_never_produces_special_ids_for_their_names(bpe):
    """A document that merely contains the text `<eos>` must not get an EOS separator in the middle."""
    text = "x = '<eos>' if tag == '<pad>' else '<mask><cls>'"
    ids = bpe.encode(text)
    assert not set(ids) & {PAD_ID, EOS_ID, MASK_ID, CLS_ID}
    assert bpe.decode(ids) == text
    assert int(bpe.token_bytes[ids].sum()) == len(text.encode())


def test_bpe_fingerprint(trained, tmp_path):
    bpe, path = trained
    reloaded = BPETokenizer(path)
    assert reloaded.fingerprint == bpe.fingerprint
    assert reloaded.encode("def value") == bpe.encode("def value")
    assert np.array_equal(reloaded.token_bytes, bpe.token_bytes)
    moved = tmp_path / "moved.json"
    moved.write_bytes(path.read_bytes())
    assert BPETokenizer(moved).fingerprint == bpe.fingerprint  # names the content, not the path
    other = train_bpe(training_texts(), 300, tmp_path / "other.json")
    assert other.fingerprint != bpe.fingerprint
    assert bpe.fingerprint != ByteTokenizer().fingerprint
    assert not list(tmp_path.glob("*.tmp*"))


def test_train_bpe_rejects_too_small_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=260"):
        train_bpe(training_texts(2), 260, tmp_path / "tokenizer.json")
    assert not (tmp_path / "tokenizer.json").exists()


def test_bpe_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrain-data tokenizer"):
        BPETokenizer(tmp_path / "missing.json")


def test_bpe_rejects_wrong_special_ids(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    raw = HFTokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>"))
    raw.add_special_tokens(list(SPECIAL_TOKENS))
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="<pad> must have id 0"):
        BPETokenizer(tmp_path / "tokenizer.json")


@pytest.fixture()
def shard_dir(tmp_path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, text in enumerate(training_texts(12)):
        (corpus / f"{number:02d}.txt").write_text(text)
    out = tmp_path / "shards"
    settings = BuildSettings(validation_fraction=0.2, max_shard_samples=3, max_shard_bytes=1_000_000)
    build_shards(read_source(str(corpus)), out, [str(corpus)], settings, show_progress=False)
    return out


def test_cli_tokenizer_writes_into_shard_dir(shard_dir, capsys):
    cli_main(["tokenizer", "--data", str(shard_dir), "--vocab-size", "300"])
    path = shard_dir / "tokenizer.json"
    tokenizer = BPETokenizer(path)
    assert 260 < tokenizer.vocab_size <= 300
    assert f"fingerprint {tokenizer.fingerprint}" in capsys.readouterr().out
    # Trained on the training shards only: the same as training on their texts directly.
    texts = [s["txt"].decode() for url in Manifest.load(shard_dir).urls("train") for s in read_shard(url)]
    direct = train_bpe(texts, 300, shard_dir.parent / "direct.json")
    assert (
        json.loads(path.read_text())["model"]["vocab"]
        == json.loads((shard_dir.parent / "direct.json").read_text())["model"]["vocab"]
    )
    assert direct.vocab_size == tokenizer.vocab_size
    Manifest.load(shard_dir)  # the extra file does not disturb the dataset


def test_cli_tokenizer_out_option(shard_dir, tmp_path):
    out = tmp_path / "elsewhere" / "bpe.json"
    cli_main(["tokenizer", "--data", str(shard_dir), "--vocab-size", "300", "--out", str(out)])
    assert BPETokenizer(out).vocab_size <= 300
    assert not (shard_dir / "tokenizer.json").exists()


def test_cli_tokenizer_without_shards(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["tokenizer", "--data", str(tmp_path), "--vocab-size", "300"])
    assert "pretrain-data build" in str(exit_info.value.code)
