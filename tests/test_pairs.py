"""Pairs: docstring/code extraction, pair shards, the pair stream and DataModule, and bad pair input."""

from __future__ import annotations

import io
import itertools
import json
import tarfile
import textwrap
import warnings
from pathlib import Path

import pytest

from conftest import packed_blocks, tokenized_pairs
from pretraining.cli import data as data_cli
from pretraining.data.corpus import CorpusError, Document, read_source
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.manifest import PAIR_FIELDS, Manifest
from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.pairs import PairCounts, docstring_pairs
from pretraining.data.reader import read_shard
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.stream import Cursor, ShardStream
from pretraining.data.tokenizer import CLS_ID, PAD_ID, ByteTokenizer
from pretraining.data.validation import DEVICE_MULTIPLE
from pretraining.errors import ShardError

SOURCE = textwrap.dedent(
    '''\
    """Module docstring: not a pair."""
    import functools


    def plain(a, b):
        """Add two numbers together.

        More detail that is not part of the query.
        """
        return a + b


    @functools.cache
    def decorated(x):  # a comment
        """Return the square of x, cached."""
        return x * x


    def one_liner(): "Say hello to the world."


    async def fetch(url):
        """Fetch the page at url."""
        return url


    def short():
        """Too short."""


    def test_something():
        """A test function is left out."""


    class TestWidget:
        """A test class is left out too."""


    def execvpe(file, args, env):
        """execvpe(file, args, env)

        A signature is no description.
        """


    class Widget:
        """A small widget that café users like."""

        size = 3

        def __repr__(self):
            """Dunder methods are left out."""
            return "Widget"

        def grow(self, by):
            """Grow the widget by some amount."""

            def helper():
                """Nested helpers are pairs too."""
                return by

            return helper()
    '''
)


def pairs_of(source: str, counts: PairCounts | None = None) -> dict[str, Document]:
    documents = docstring_pairs([Document("code:mod.py", {"txt": source})], counts)
    return {document.meta["name"]: document for document in documents}


def test_docstring_pairs_from_python_source() -> None:
    counts = PairCounts()
    pairs = pairs_of(SOURCE, counts)
    assert list(pairs) == ["plain", "decorated", "one_liner", "fetch", "Widget", "Widget.grow", "Widget.grow.helper"]
    assert {name: d.meta["kind"] for name, d in pairs.items()} == {
        "plain": "function",
        "decorated": "function",
        "one_liner": "function",
        "fetch": "function",
        "Widget": "class",
        "Widget.grow": "method",
        "Widget.grow.helper": "function",
    }
    assert all(d.source_id == "code:mod.py" for d in pairs.values())
    assert pairs["plain"].texts == {
        "query.txt": "Add two numbers together.",
        "passage.txt": "def plain(a, b):\n    return a + b",
    }
    assert pairs["decorated"].texts["passage.txt"] == (
        "@functools.cache\ndef decorated(x):  # a comment\n    return x * x"
    )
    assert pairs["one_liner"].texts["passage.txt"] == "def one_liner():"
    assert pairs["fetch"].texts["passage.txt"].startswith("async def fetch(url):\n    return url")
    widget = pairs["Widget"].texts["passage.txt"]
    assert widget.startswith("class Widget:\n\n    size = 3") and "café" not in widget
    grow = pairs["Widget.grow"].texts["passage.txt"]
    assert grow.startswith("def grow(self, by):\n") and "Grow the widget" not in grow
    # Nested definitions' docstrings are other pairs' queries: cut from the passage too.
    assert grow == "def grow(self, by):\n\n    def helper():\n        return by\n\n    return helper()"
    queries = [d.texts["query.txt"] for d in pairs.values() if d.texts]
    passages = [d.texts["passage.txt"] for d in pairs.values() if d.texts]
    assert not any(query in passage for query in queries for passage in passages)
    assert "Dunder methods" not in widget and "Grow the widget" not in widget
    assert counts == PairCounts(files=1, documented=12, trivial_docstrings=2, excluded_names=3, pairs=7)


def test_docstring_pairs_line_ends_and_form_feeds() -> None:
    """ast counts \\r and \\r\\n as line ends but not a form feed; the cut must agree with it."""
    source = 'import os\r\n\x0c\r\ndef plus_one(x):\r    """Return the value of x plus one."""\r\n    return x + 1\r\n'
    (pair,) = pairs_of(source).values()
    assert pair.texts == {
        "query.txt": "Return the value of x plus one.",
        "passage.txt": "def plus_one(x):\n    return x + 1",
    }


def test_docstring_pairs_skip_what_is_not_python() -> None:
    counts = PairCounts()
    documents = [
        Document("code:broken.py", {"txt": "def f(:\n    '''Does this and that.'''"}),
        Document("code:notes.txt", {"txt": SOURCE}),
        Document("code:latin1.py", None),
        Document("code:mod.py", {"txt": SOURCE}),
        Document("code:pkg/tests/helpers.py", {"txt": SOURCE}),
        Document("stdlib:idlelib/idle_test/mock.py", {"txt": SOURCE}),
    ]
    assert len(list(docstring_pairs(documents, counts))) == 7
    assert (counts.files, counts.test_files, counts.unparsable_files) == (4, 2, 1)


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def module_source(number: int) -> str:
    functions = [
        f'def function_{number}_{k}(value):\n    """Compute result {k} of module {number} from the value."""\n'
        f"    return value * {k} + {number}\n"
        for k in range(6)
    ]
    return "\n\n".join(functions)


def test_build_pair_shards_split_by_file_and_dedup(tmp_path: Path) -> None:
    files = {f"pkg/mod_{n}.py": module_source(n) for n in range(12)}
    # Same docstring as mod_0's first function, other code: a false negative in waiting, dropped.
    files["pkg/zz_copy.py"] = 'def other(v):\n    """Compute result 0 of module 0 from the value."""\n    return -v\n'
    corpus = write_package(tmp_path / "corpus", files)
    counts = PairCounts()
    settings = BuildSettings(validation_fraction=0.3, max_shard_samples=10)
    documents = docstring_pairs(read_source(str(corpus)), counts)
    provenance = lambda: {"docstring_pairs": vars(counts)}  # noqa: E731
    manifest = build_shards(documents, tmp_path / "pairs", [str(corpus)], settings, False, PAIR_FIELDS, provenance)
    assert manifest["fields"] == ["query.txt", "passage.txt"]
    assert manifest["provenance"]["docstring_pairs"]["pairs"] == 73
    assert manifest["dedup"]["exact_duplicates_dropped"] == 1
    loaded = Manifest.load(tmp_path / "pairs")
    assert loaded.fields == PAIR_FIELDS
    split_of_file: dict[str, set[str]] = {}
    for split in ("train", "validation"):
        for url in loaded.urls(split):
            for sample in read_shard(url):
                assert set(sample) >= {"query.txt", "passage.txt", "json"}
                meta = json.loads(sample["json"])
                split_of_file.setdefault(meta["source_id"], set()).add(split)
                assert meta["kind"] == "function" and meta["name"].startswith("function_")
    assert len(split_of_file) == 12 and all(len(splits) == 1 for splits in split_of_file.values())
    assert {next(iter(s)) for s in split_of_file.values()} == {"train", "validation"}


def test_pair_datamodule_batches(pair_dir: Path) -> None:
    dm = ShardDataModule(
        str(pair_dir), ByteTokenizer(), format=tokenized_pairs(16, 48), global_batch_size=5, num_workers=0
    )
    assert dm.format.kind == "pairs"
    batch = next(iter(dm.train_dataloader()))
    assert batch["query"].shape == (5, 16) and batch["passage"].shape == (5, 48)
    assert (batch["query"][:, 0] == CLS_ID).all() and (batch["passage"][:, 0] == CLS_ID).all()
    assert batch["sample_id"].shape == (5,) and len(set(batch["sample_id"].tolist())) == 5
    assert int(batch["skipped"]) == 0
    # Real texts fill the short query side; a short text is padded with PAD after its tokens.
    assert (batch["query"] != PAD_ID).sum(1).max() == 16
    (validation,) = dm.validation_sets
    assert [int(e["sample_id"]) for e in validation[:5]] == list(range(5))
    texts = [s["query.txt"].decode() for s in read_shard(Manifest.load(pair_dir).urls("validation")[0])]
    tokens = ByteTokenizer().encode(texts[0])[:15]
    assert validation[0]["query"].tolist() == [CLS_ID, *tokens] + [PAD_ID] * (15 - len(tokens))


def test_data_and_shards_must_match(pair_dir: Path, shard_dir: Path) -> None:
    with pytest.raises(ShardError, match=r"text_field='txt': .* all have query.txt, passage.txt: .*data=text"):
        ShardDataModule(str(pair_dir), ByteTokenizer(), format=packed_blocks(32), global_batch_size=2)
    with pytest.raises(ShardError, match=r"query_field='query.txt' and .*passage_field=.* all have txt: .*data=pairs"):
        ShardDataModule(str(shard_dir), ByteTokenizer(), format=tokenized_pairs(8, 8), global_batch_size=2)
    with pytest.raises(ValueError, match=r"data\.format\.query_len=1 must be at least 2"):
        ShardDataModule(str(pair_dir), ByteTokenizer(), format=tokenized_pairs(1, 8), global_batch_size=2)


def write_tar(path: Path, samples: list[dict[str, bytes]]) -> str:
    with tarfile.open(path, "w") as tar:
        for number, sample in enumerate(samples):
            for field, data in sample.items():
                info = tarfile.TarInfo(f"s{number:03d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_unusable_pairs_are_skipped_counted_and_named(tmp_path: Path) -> None:
    good = {"query.txt": b"add two numbers", "passage.txt": b"def add(a, b): return a + b"}
    samples = [
        good,
        {"query.txt": b"only a query"},  # missing its passage
        {"query.txt": b"   ", "passage.txt": b"x = 1"},  # empty query
        {"query.txt": b"bad bytes", "passage.txt": b"caf\xe9"},  # not UTF-8
        {"query.txt": b"sub two numbers", "passage.txt": b"def sub(a, b): return a - b"},
        {"passage.txt": b"def lonely(): pass"},  # missing its query
    ]
    url = write_tar(tmp_path / "bad.tar", samples)
    stream = ShardStream([url], TokenizedPairs(ByteTokenizer(), 8, 16), seed=0, shuffle_buffer=1)
    with pytest.warns(UserWarning) as caught:
        examples = list(itertools.islice(stream.examples(0, 1, Cursor()), 6))  # three epochs of the one shard
    # Each example carries the skips read before it was handed out: the 4 of the shard's first epoch, counted once.
    assert [e.skipped for e in examples] == [3, 1, 0, 0, 0, 0]
    assert [e.example.query[1:4] for e in examples[:2]] == [[b + 4 for b in b"add"], [b + 4 for b in b"sub"]]
    messages = [str(w.message) for w in caught]
    assert any("'s001'" in m and "bad.tar" in m and "no 'passage.txt' field" in m for m in messages)
    assert any("'s002'" in m and "'query.txt' is empty" in m for m in messages)
    assert any("'s003'" in m and "'passage.txt' is not UTF-8" in m for m in messages)
    # A restart from any cursor neither loses nor counts twice a skip, also when the shuffle buffer reads ahead.
    for buffer in (1, 3):
        stream = ShardStream([url], TokenizedPairs(ByteTokenizer(), 8, 16), seed=0, shuffle_buffer=buffer)
        with pytest.warns(UserWarning):
            reference = list(itertools.islice(stream.examples(0, 1, Cursor()), 6))
        assert sum(e.skipped for e in reference) == 4
        for k, example in enumerate(reference[:-1]):
            with warnings.catch_warnings():  # a restart past the shard's first epoch names no bad sample again
                warnings.simplefilter("ignore")
                again = list(itertools.islice(stream.examples(0, 1, example.cursor), 5 - k))
            assert [e.skipped for e in again] == [e.skipped for e in reference[k + 1 :]], (buffer, k)


def test_a_shard_with_no_usable_pair_is_an_error(tmp_path: Path) -> None:
    url = write_tar(tmp_path / "empty.tar", [{"query.txt": b"q"}, {"passage.txt": b"p"}])
    stream = ShardStream([url], TokenizedPairs(ByteTokenizer(), 8, 16), seed=0)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no shard yields a whole example"):
        next(stream.examples(0, 1, Cursor()))


def test_cli_builds_pairs_from_python_and_jsonl(tmp_path: Path, capsys) -> None:
    corpus = write_package(tmp_path / "code", {f"mod_{n}.py": module_source(n) for n in range(4)})
    data_cli(["build", "--pairs", "--source", str(corpus), "--out", str(tmp_path / "code_pairs"), "--quiet"])
    output = capsys.readouterr().out
    assert "docstring pairs:" in output and "'pairs': 24" in output
    assert output.splitlines()[-1] == f"train on it: pretrain data.dir={(tmp_path / 'code_pairs').resolve()} data=pairs"
    assert Manifest.load(tmp_path / "code_pairs").fields == PAIR_FIELDS

    records = [{"doc": f"question number {n}", "code": f"answer = {n}"} for n in range(30)]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "jsonl_pairs"
    fields = ["--query-field", "doc", "--passage-field", "code"]
    data_cli(["build", "--pairs", "--source", str(jsonl), *fields, "--out", str(out), "--quiet"])
    stored = [
        (s["query.txt"].decode(), s["passage.txt"].decode())
        for split in ("train", "validation")
        for url in Manifest.load(out).urls(split)
        for s in read_shard(url)
    ]
    assert sorted(stored) == sorted((r["doc"], r["code"]) for r in records)

    with pytest.raises(SystemExit, match=r"pairs\.jsonl:1 is not a JSON object with string 'query' and 'passage'"):
        data_cli(["build", "--pairs", "--source", str(jsonl), "--out", str(tmp_path / "x"), "--quiet"])
    assert not (tmp_path / "x").exists()


def test_jsonl_pair_missing_a_side_names_the_line(tmp_path: Path) -> None:
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text('{"query": "a", "passage": "b"}\n{"query": "only one side"}\n')
    documents = read_source(str(jsonl), {"query.txt": "query", "passage.txt": "passage"})
    assert next(documents).texts == {"query.txt": "a", "passage.txt": "b"}
    with pytest.raises(CorpusError, match=r"pairs\.jsonl:2\b"):
        next(documents)


def test_a_build_of_few_pairs_warns_that_its_validation_is_too_small(tmp_path: Path, capsys) -> None:
    """40 pairs at the default --validation-fraction: a handful of validation pairs (training refuses none, and
    validates on fewer than DEVICE_MULTIPLE alike on some device counts only), said at build time."""
    records = [{"query": f"what is item {n}?", "passage": f"item = {n}"} for n in range(40)]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    data_cli(["build", "--pairs", "--source", str(jsonl), "--out", str(tmp_path / "small"), "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    documents = sum(shard.samples for shard in Manifest.load(tmp_path / "small").shards("validation"))
    assert documents < DEVICE_MULTIPLE
    assert lines[-2] == (
        f"warning: the validation split has {documents} documents, fewer than the {DEVICE_MULTIPLE} validation "
        f"examples a run shares alike on up to {DEVICE_MULTIPLE} devices (training refuses fewer than one per "
        f"device; a pair is one example): raise --validation-fraction, or give a larger --validation-source"
    )
    assert lines[-1].startswith("train on it: ")

    data_cli(
        [
            "build",
            "--pairs",
            "--source",
            str(jsonl),
            "--validation-fraction",
            "0.5",
            "--out",
            str(tmp_path / "big"),
            "--quiet",
        ]
    )
    assert "warning" not in capsys.readouterr().out
