"""`pretrain-data build` from Parquet and from datasets saved by Hugging Face `datasets`, and the refusal
of binary files where text was expected."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import sys
import tarfile
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pretraining.cli import data as cli_main
from pretraining.data import commands
from pretraining.data.corpus import binary_kind
from pretraining.data.manifest import PAIR_FIELDS
from pretraining.data.shards import split_of
from pretraining.data.validation import DEVICE_MULTIPLE

FRACTION = 0.3
TEXTS = [f"document {n}: " + " ".join(f"word{n * k % 17}" for k in range(n % 7 + 3)) for n in range(40)]


def build(*argv: str) -> None:
    cli_main(["build", *argv, "--validation-fraction", str(FRACTION), "--quiet"])


def stored(out: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """source id -> (split, texts) of every sample of a built dataset, read with tarfile alone."""
    manifest = json.loads((out / "manifest.json").read_text())
    samples = {}
    for split, entry in manifest["splits"].items():
        for shard in entry["shards"]:
            with tarfile.open(out / shard["name"]) as tar:
                members = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
            for name, value in members.items():
                if name.endswith(".json"):
                    key = name.removesuffix(".json")
                    texts = {n.split(".", 1)[1]: v for n, v in members.items() if n.startswith(key + ".")}
                    del texts["json"]
                    samples[json.loads(value)["source_id"]] = (split, texts)
    return samples


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=7)  # several row groups, read batch by batch
    return path


def save_to_disk(directory: Path, table: pa.Table, num_shards: int = 2) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes (arrow_dataset.py): Arrow IPC *stream* files
    data-XXXXX-of-XXXXX.arrow, state.json listing them in `_data_files`, and dataset_info.json."""
    directory.mkdir(parents=True)
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    names, start = [], 0
    for index in range(num_shards):
        rows = len(table) // num_shards + (index < len(table) % num_shards)
        names.append(f"data-{index:05d}-of-{num_shards:05d}.arrow")
        with pa.OSFile(str(directory / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(start, rows), max_chunksize=5)
        start += rows
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (directory / "dataset_info.json").write_text(json.dumps({"citation": "", "features": features}, indent=2))
    return directory


def build_error(tmp_path: Path, *argv: str) -> str:
    """The one-line error of a build that must stop before writing anything."""
    with pytest.raises(SystemExit) as stopped:
        build(*argv, "--out", str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists() and not (tmp_path / ".refused.building").exists()
    message = str(stopped.value.code)
    assert message.startswith("pretrain-data build: error: ") and "\n" not in message
    return message


def test_parquet_builds_every_row_and_its_id_decides_the_split(tmp_path: Path, capsys) -> None:
    ids = [f"doc-{n}" for n in range(len(TEXTS))]
    texts = [*TEXTS[:39], None]  # a null text is dropped and counted
    write_parquet(tmp_path / "corpus/b.parquet", {"text": texts[20:], "id": ids[20:]})
    write_parquet(tmp_path / "corpus/a.parquet", {"text": texts[:20], "id": ids[:20], "other": list(range(20))})
    build("--source", str(tmp_path / "corpus"), "--id-field", "id", "--out", str(tmp_path / "first"))
    assert "1 not UTF-8 (or a null in a table)" in capsys.readouterr().out
    samples = stored(tmp_path / "first")
    assert samples == {i: (split_of(i, FRACTION), {"txt": t}) for i, t in zip(ids[:39], TEXTS[:39], strict=True)}
    assert {split for split, _ in samples.values()} == {"train", "validation"}

    # Other files, another order: every id keeps its split.
    write_parquet(tmp_path / "again/only.parquet", {"id": ids[::-1], "text": texts[::-1]})
    build("--source", str(tmp_path / "again"), "--id-field", "id", "--out", str(tmp_path / "second"))
    assert stored(tmp_path / "second") == samples

    # Without --id-field a row is `<file name>:<row>`, files in sorted order.
    build("--source", str(tmp_path / "corpus"), "--out", str(tmp_path / "by_row"))
    by_row = stored(tmp_path / "by_row")
    assert by_row["a.parquet:0"][1] == {"txt": TEXTS[0]} and by_row["b.parquet:18"][1] == {"txt": TEXTS[38]}
    assert len(by_row) == 39


def test_a_build_of_99_parquet_rows_warns_that_its_validation_is_too_small(tmp_path: Path, capsys) -> None:
    """The default --validation-fraction of 99 rows holds out a handful: said at build time, naming the flags."""
    source = write_parquet(tmp_path / "rows.parquet", {"text": [f"row {n}: " + "word " * n for n in range(99)]})
    cli_main(["build", "--source", str(source), "--out", str(tmp_path / "small"), "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    documents = json.loads((tmp_path / "small/manifest.json").read_text())["splits"]["validation"]["documents"]
    assert 0 < documents < DEVICE_MULTIPLE
    assert lines[-2].startswith(f"warning: the validation split has {documents} documents, fewer than the 8 ")
    assert lines[-2].endswith("raise --validation-fraction or --validation-tail, or give a larger --validation-source")
    assert lines[-1].startswith("train on it: ")


def test_parquet_pairs(tmp_path: Path) -> None:
    queries, passages = [f"question {n}?" for n in range(30)], [f"answer = {n}" for n in range(30)]
    source = write_parquet(tmp_path / "pairs.parquet", {"q": queries, "p": passages})
    build(
        "--pairs", "--source", str(source), "--query-field", "q", "--passage-field", "p", "--out", str(tmp_path / "o")
    )
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert tuple(manifest["fields"]) == PAIR_FIELDS
    samples = stored(tmp_path / "o")
    assert sorted(samples) == sorted(f"pairs.parquet:{n}" for n in range(30))
    expected = {(q, p) for q, p in zip(queries, passages, strict=True)}
    assert {(texts["query.txt"], texts["passage.txt"]) for _, texts in samples.values()} == expected

    message = build_error(tmp_path, "--pairs", "--source", str(source), "--query-field", "q")
    assert "no column 'passage' (it has 'q', 'p')" in message and "--passage-field" in message


def test_a_dataset_saved_by_datasets_is_read_in_state_json_order(tmp_path: Path) -> None:
    table = pa.table({"text": TEXTS, "title": [f"t{n}" for n in range(len(TEXTS))]})
    source = save_to_disk(tmp_path / "saved", table, num_shards=3)
    # A file that state.json does not list (a cache file of `datasets`) is not part of the dataset.
    with pa.OSFile(str(source / "cache-0a1b.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(pa.table({"text": ["stale cache row"], "title": ["x"]}, schema=table.schema))
    build("--source", str(source), "--out", str(tmp_path / "o"))
    assert stored(tmp_path / "o") == {
        f"saved:{n}": (split_of(f"saved:{n}", FRACTION), {"txt": text}) for n, text in enumerate(TEXTS)
    }

    # The rows are numbered across files in the order state.json lists them.
    state = json.loads((source / "state.json").read_text())
    state["_data_files"].reverse()
    (source / "state.json").write_text(json.dumps(state))
    build("--source", str(source), "--out", str(tmp_path / "reversed"), "--text-field", "title")
    assert stored(tmp_path / "reversed")["saved:0"][1] == {"txt": "t27"}  # the first row of the last file

    message = build_error(tmp_path, "--source", str(source), "--id-field", "uid")
    assert "data-00002-of-00003.arrow has no column 'uid' (it has 'text', 'title')" in message
    assert "--id-field" in message


def test_a_dataset_dict_is_refused_naming_its_splits(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    for split in ("train", "test"):
        save_to_disk(root / split, pa.table({"text": TEXTS}))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    message = build_error(tmp_path, "--source", str(root))
    assert "DatasetDict with splits test, train" in message
    assert f"--source {root / 'train'}" in message
    build("--source", str(root / "train"), "--out", str(tmp_path / "o"))
    assert len(stored(tmp_path / "o")) == len(TEXTS)


def test_a_missing_or_non_text_column_names_the_columns_and_the_option(tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "t.parquet", {"body": TEXTS, "n": list(range(len(TEXTS)))})
    message = build_error(tmp_path, "--source", str(source))
    assert "t.parquet has no column 'text' (it has 'body', 'n')" in message and "--text-field" in message
    message = build_error(tmp_path, "--source", str(source), "--text-field", "n")
    assert "column 'n'" in message and "int64, not text" in message


def test_a_null_id_stops_naming_the_row(tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "t.parquet", {"text": TEXTS[:3], "id": ["a", None, "c"]})
    message = build_error(tmp_path, "--source", str(source), "--id-field", "id")
    assert "t.parquet: row 1 of t.parquet has a null 'id'" in message


def test_without_pyarrow_a_table_source_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    source = write_parquet(tmp_path / "t.parquet", {"text": TEXTS})
    for module in ("pyarrow", "pyarrow.ipc", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, module, None)
    assert "pip install 'pretraining[formats]'" in build_error(tmp_path, "--source", str(source))


def tar_shard() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("000.txt", b"a sample"), ("000.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo("a.txt"), "text")  # dated 1980, not now: the same bytes in every worker
    return buffer.getvalue()


PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR"


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (tar_shard(), "tar"),
        (gzip.compress(b"text", mtime=0), "gzip"),  # no time in it: pytest-xdist's workers must collect alike
        (bz2.compress(b"text"), "bzip2"),
        (bz2.compress(b""), "bzip2"),
        (lzma.compress(b"text"), "xz"),
        (b"\x28\xb5\x2f\xfd" + b"frame", "zstd"),
        (zip_bytes(), "zip"),
        (PNG, "PNG"),
        (b"\xff\xd8\xff\xe0JFIF", "JPEG"),
        (b"GIF89a\x01\x00", "GIF"),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", "PDF"),
        (b"x" * 8000 + b"\x00", "NUL bytes"),
        (b"x" * 8192 + b"\x00", None),  # past the first 8 KiB
        (b"BZh is how this text begins", None),
        ("caf\u00e9 na\u00efve".encode("latin-1"), None),
        ("plain text, caf\u00e9".encode(), None),
    ],
)
def test_binary_kind(tmp_path: Path, data: bytes, kind: str | None) -> None:
    path = tmp_path / "file"
    path.write_bytes(data)
    assert binary_kind(path) == kind


def text_corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for number, text in enumerate(TEXTS):
        (root / f"doc{number:02d}.txt").write_text(text)
    return root


def test_binary_files_in_a_text_directory_are_refused_naming_them(tmp_path: Path, monkeypatch) -> None:
    corpus = text_corpus(tmp_path / "texts")
    (corpus / "images").mkdir()
    (corpus / "images/logo.png").write_bytes(PNG)
    (corpus / "notes.txt.gz").write_bytes(gzip.compress(b"notes"))
    # Every source is checked before the build starts: the good one first does not start it.
    monkeypatch.setattr(commands, "build_shards", lambda *args, **kwargs: pytest.fail("the build started"))
    message = build_error(tmp_path, "--source", str(text_corpus(tmp_path / "good")), "--source", str(corpus))
    assert "2 binary file(s) where text was expected" in message
    assert f"{corpus / 'images/logo.png'} (PNG)" in message and f"{corpus / 'notes.txt.gz'} (gzip)" in message
    assert "pretrain-data index" not in message


def test_shards_given_as_a_corpus_point_to_pretrain_data_index(tmp_path: Path) -> None:
    corpus = tmp_path / "shards"
    corpus.mkdir()
    for number in range(7):
        (corpus / f"train-{number:06d}.tar").write_bytes(tar_shard())
    message = build_error(tmp_path, "--source", str(corpus))
    assert "7 binary file(s)" in message and "train-000000.tar (tar)" in message and "and 2 more" in message
    assert "WebDataset shards" in message and "pretrain-data index" in message

    # A compressed shard by its name, and a single shard given as the source.
    (tmp_path / "one.tgz").write_bytes(gzip.compress(tar_shard()))
    assert "pretrain-data index" in build_error(tmp_path, "--source", str(tmp_path / "one.tgz"))
    assert "pretrain-data index" in build_error(tmp_path, "--source", str(corpus / "train-000003.tar"))


def test_text_that_is_not_utf8_is_dropped_and_counted_not_refused(tmp_path: Path, capsys) -> None:
    corpus = text_corpus(tmp_path / "texts")
    (corpus / "latin1.py").write_bytes("# caf\u00e9, na\u00efve\nx = '\u00ff'\n".encode("latin-1"))
    build("--source", str(corpus), "--out", str(tmp_path / "o"))
    assert "1 not UTF-8" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert manifest["dedup"]["undecodable_dropped"] == 1
    assert len(stored(tmp_path / "o")) == len(TEXTS)


def test_a_source_trees_hidden_directories_and_pycache_are_not_read(tmp_path: Path, capsys) -> None:
    corpus = text_corpus(tmp_path / "texts")
    for machinery in (corpus / "__pycache__" / "a.cpython-311.pyc", corpus / ".git" / "objects" / "ab" / "cdef"):
        machinery.parent.mkdir(parents=True)
        machinery.write_bytes(gzip.compress(b"compiled or packed, not text"))
    build("--source", str(corpus), "--out", str(tmp_path / "o"))
    assert "0 not UTF-8" in capsys.readouterr().out
    assert len(stored(tmp_path / "o")) == len(TEXTS)


def test_a_directory_mixing_parquet_and_other_files_is_refused_naming_both(tmp_path: Path) -> None:
    corpus = text_corpus(tmp_path / "texts")
    write_parquet(corpus / "sub" / "fixture.parquet", {"text": TEXTS[:3]})
    message = build_error(tmp_path, "--source", str(corpus))
    assert "1 .parquet files and" in message and "not both" in message
    (tmp_path / "spark").mkdir()
    write_parquet(tmp_path / "spark" / "part-0.parquet", {"text": TEXTS})
    (tmp_path / "spark" / "_SUCCESS").write_text("")  # a writer's marker is not a document
    build("--source", str(tmp_path / "spark"), "--out", str(tmp_path / "o"))
    assert len(stored(tmp_path / "o")) == len(TEXTS)


def test_an_id_field_for_text_files_is_refused(tmp_path: Path) -> None:
    corpus = text_corpus(tmp_path / "texts")
    for source in (str(corpus), "stdlib"):
        assert "--id-field=id names a field of records" in build_error(tmp_path, "--source", source, "--id-field", "id")
