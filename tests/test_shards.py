"""The shard builder, the manifest, the corpus readers and the `pretrain-data build` CLI."""

from __future__ import annotations

import hashlib
import json
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import webdataset

from pretraining.cli import data as cli_main
from pretraining.data.corpus import CorpusError, Document, normalize, read_jsonl, read_source
from pretraining.data.manifest import MANIFEST, SPLITS, Manifest
from pretraining.data.reader import read_shard
from pretraining.data.shards import BuildSettings, build_shards, split_of
from pretraining.errors import ShardError

VALIDATION_FRACTION = 0.3
SETTINGS = BuildSettings(validation_fraction=VALIDATION_FRACTION, max_shard_samples=4, max_shard_bytes=4096)
WORDS = ["def", "return", "self", "import", "value", "café", "naïve", "Ελληνικά", "日本語", "🙂", "x", "(", ")", ":"]


def make_text(rng: random.Random, number: int) -> str:
    lines = [f"document {number}"]
    for _ in range(rng.randint(2, 12)):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))))
    return "\n".join(lines) + "\n"


def write_corpus(root: Path, documents: int = 40, seed: int = 0) -> Path:
    """Text files plus an exact duplicate, a CRLF duplicate, an empty, a blank and a non-UTF-8 file."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(documents):
        (root / f"doc_{number:03d}.txt").write_text(make_text(rng, number), encoding="utf-8")
    (root / "sub").mkdir()
    # NFD input (e + combining acute) and trailing whitespace: stored as NFC without the trailing blanks.
    (root / "sub" / "nested.txt").write_bytes("\n\nnested cafe\u0301 file  \n\n".encode())
    original = (root / "doc_003.txt").read_bytes()
    (root / "zz_copy_of_doc_003.txt").write_bytes(original)
    (root / "zz_crlf_copy_of_doc_005.txt").write_bytes((root / "doc_005.txt").read_bytes().replace(b"\n", b"\r\n"))
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_bytes(b"  \n\t\n")
    (root / "latin1.txt").write_bytes("caf\u00e9 na\u00efve \u00ff".encode("latin-1"))
    return root


def expected_documents(root: Path) -> dict[str, str]:
    """source id -> normalised text of every document the builder must keep (first copy wins)."""
    kept: dict[str, str] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        try:
            text = normalize(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if text and text not in kept.values():
            kept[f"{root.name}:{path.relative_to(root).as_posix()}"] = text
    return kept


def build(corpus: Path, out: Path, settings: BuildSettings = SETTINGS) -> dict:
    return build_shards(read_source(str(corpus)), out, [str(corpus)], settings, show_progress=False)


def tar_samples(path: Path) -> list[tuple[str, str, dict]]:
    """(key, text, meta) of each sample of a shard, read with `tarfile` alone."""
    with tarfile.open(path) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    keys = sorted({name.rsplit(".", 1)[0] for name in members})
    assert set(members) == {f"{k}.{ext}" for k in keys for ext in ("txt", "json")}
    return [(k, members[f"{k}.txt"].decode("utf-8"), json.loads(members[f"{k}.json"])) for k in keys]


def shard_files(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "texts")


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("built") / "shards"
    manifest = build(corpus, out)
    return out, manifest


def copy_dataset(dataset, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(dataset[0], target)
    return target


def test_fixture_has_several_shards_per_split(dataset):
    _, manifest = dataset
    for split in SPLITS:
        assert len(manifest["splits"][split]["shards"]) >= 3, split


def test_round_trip_with_tarfile(corpus, dataset):
    out, manifest = dataset
    expected = expected_documents(corpus)
    seen: Counter[str] = Counter()
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            for _, text, meta in tar_samples(out / shard["name"]):
                assert expected[meta["source_id"]] == text
                assert meta["sha256"] == {"txt": hashlib.sha256(text.encode()).hexdigest()}
                seen[meta["source_id"]] += 1
    assert seen == Counter(expected.keys())
    assert expected["texts:sub/nested.txt"] == "nested caf\u00e9 file"


def test_round_trip_with_webdataset(corpus, dataset):
    out, _ = dataset
    manifest = Manifest.load(out)
    expected = expected_documents(corpus)
    texts = []
    for split in SPLITS:
        for sample in webdataset.WebDataset(manifest.urls(split), shardshuffle=False, empty_check=False):
            texts.append(sample["txt"].decode("utf-8"))
    assert sorted(texts) == sorted(expected.values())
    streamed = [s["txt"].decode("utf-8") for split in SPLITS for url in manifest.urls(split) for s in read_shard(url)]
    assert sorted(streamed) == sorted(expected.values())


def test_duplicates_empty_and_undecodable_are_dropped_and_counted(corpus, dataset):
    _, manifest = dataset
    dedup = manifest["dedup"]
    files = [p for p in corpus.rglob("*") if p.is_file()]
    assert dedup["documents_read"] == len(files)
    assert dedup["exact_duplicates_dropped"] == 2
    assert dedup["empty_dropped"] == 2
    assert dedup["undecodable_dropped"] == 1
    kept = sum(manifest["splits"][split]["documents"] for split in SPLITS)
    assert kept == len(files) - 5 == len(expected_documents(corpus))
    shards = [dataset[0] / s["name"] for split in SPLITS for s in manifest["splits"][split]["shards"]]
    ids = {meta["source_id"] for shard in shards for _, _, meta in tar_samples(shard)}
    assert "texts:doc_003.txt" in ids and "texts:doc_005.txt" in ids
    assert not {"texts:zz_copy_of_doc_003.txt", "texts:zz_crlf_copy_of_doc_005.txt"} & ids
    assert not {"texts:empty.txt", "texts:blank.txt", "texts:latin1.txt"} & ids


def test_manifest_matches_files_on_disk(dataset):
    out, manifest = dataset
    assert manifest["format"] == "pretraining-shards/2"
    assert manifest["fields"] == ["txt"]
    assert manifest["settings"] == {
        "validation_fraction": 0.3,
        "max_shard_samples": 4,
        "max_shard_bytes": 4096,
        "decontaminate": 0.7,
    }
    assert len(manifest["version"]) == 16 and int(manifest["version"], 16) >= 0
    assert json.loads((out / MANIFEST).read_text()) == manifest
    listed = []
    for split in SPLITS:
        info = manifest["splits"][split]
        for index, shard in enumerate(info["shards"]):
            path = out / shard["name"]
            assert shard["name"] == f"{split}-{index:06d}.tar"
            assert shard["bytes"] == path.stat().st_size
            assert shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            samples = tar_samples(path)
            assert shard["samples"] == len(samples)
            assert shard["text_bytes"] == sum(len(text.encode()) for _, text, _ in samples)
            listed.append(shard["name"])
        assert info["documents"] == sum(s["samples"] for s in info["shards"])
        assert info["text_bytes"] == sum(s["text_bytes"] for s in info["shards"])
    assert sorted(p.name for p in out.iterdir()) == sorted([*listed, MANIFEST])
    loaded = Manifest.load(out)
    assert loaded.version == manifest["version"]
    assert [s.name for s in loaded.shards("train")] == [s["name"] for s in manifest["splits"]["train"]["shards"]]
    assert loaded.urls("validation") == [str(out / s["name"]) for s in manifest["splits"]["validation"]["shards"]]


def test_split_is_a_function_of_the_source_id(corpus, dataset, tmp_path):
    out, manifest = dataset
    split_by_id = {}
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            for _, _, meta in tar_samples(out / shard["name"]):
                assert meta["source_id"] not in split_by_id
                assert split_of(meta["source_id"], VALIDATION_FRACTION) == split
                split_by_id[meta["source_id"]] = split
    assert set(split_by_id.values()) == set(SPLITS)
    for source_id in split_by_id:
        assert split_of(source_id, VALIDATION_FRACTION) == split_of(source_id, VALIDATION_FRACTION)
        assert split_of(source_id, 0.0) == "train"
    # A different corpus (half the files) puts every shared document in the same split.
    subset = tmp_path / "texts"
    subset.mkdir()
    for path in sorted(corpus.glob("doc_*.txt"))[::2]:
        shutil.copy(path, subset / path.name)
    sub_manifest = build(subset, tmp_path / "sub_shards")
    for split in SPLITS:
        for shard in sub_manifest["splits"][split]["shards"]:
            for _, _, meta in tar_samples(tmp_path / "sub_shards" / shard["name"]):
                assert split_by_id[meta["source_id"]] == split


def test_keys_are_unique_across_shards_and_splits(dataset):
    out, manifest = dataset
    keys = [
        key
        for split in SPLITS
        for s in manifest["splits"][split]["shards"]
        for key, _, _ in tar_samples(out / s["name"])
    ]
    assert len(keys) == len(set(keys)) == sum(manifest["splits"][split]["documents"] for split in SPLITS)


@pytest.mark.parametrize("max_shard_bytes", [4096, 30_000])
def test_shard_size_bound(corpus, tmp_path, max_shard_bytes):
    settings = BuildSettings(
        validation_fraction=VALIDATION_FRACTION, max_shard_samples=1000, max_shard_bytes=max_shard_bytes
    )
    manifest = build(corpus, tmp_path / "shards", settings)
    for split in SPLITS:
        shards = manifest["splits"][split]["shards"]
        assert sum(s["samples"] for s in shards) == manifest["splits"][split]["documents"]
        for shard in shards:
            assert shard["bytes"] == (tmp_path / "shards" / shard["name"]).stat().st_size
            assert shard["bytes"] <= max_shard_bytes or shard["samples"] == 1, shard


def test_shard_sample_bound(corpus, tmp_path):
    manifest = build(corpus, tmp_path / "shards", BuildSettings(VALIDATION_FRACTION, 3, 1_000_000))
    for split in SPLITS:
        samples = [s["samples"] for s in manifest["splits"][split]["shards"]]
        assert samples[:-1] == [3] * (len(samples) - 1) and 1 <= samples[-1] <= 3, samples


def test_build_is_byte_reproducible(corpus, dataset, tmp_path):
    out, manifest = dataset
    again = build(corpus, tmp_path / "again")
    assert again["version"] == manifest["version"]
    assert again["splits"] == manifest["splits"]
    assert shard_files(tmp_path / "again") == shard_files(out)
    # The version names the data: other shard contents, other version.
    other = build(corpus, tmp_path / "other", BuildSettings(0.5, 4, 4096))
    assert other["version"] != manifest["version"]


def test_rebuild_replaces_directory_completely(corpus, tmp_path):
    out = tmp_path / "shards"
    build(corpus, out)
    (out / "stray.txt").write_text("left by someone")
    manifest = build(corpus, out, BuildSettings(VALIDATION_FRACTION, 1000, 1_000_000))
    names = [s["name"] for split in SPLITS for s in manifest["splits"][split]["shards"]]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, MANIFEST])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name or p.name.endswith((".building", ".old"))]
    assert Manifest.load(out).version == manifest["version"]


def test_crash_mid_build_leaves_previous_dataset_untouched(corpus, tmp_path):
    out = tmp_path / "shards"
    build(corpus, out)
    before_manifest = (out / MANIFEST).read_bytes()
    before_files = shard_files(out)

    def crashing():
        for number, document in enumerate(read_source(str(corpus))):
            if number == 25:
                raise RuntimeError("disk on fire")
            yield document

    with pytest.raises(RuntimeError, match="disk on fire"):
        build_shards(crashing(), out, [str(corpus)], BuildSettings(VALIDATION_FRACTION, 2, 4096), show_progress=False)
    assert (out / MANIFEST).read_bytes() == before_manifest
    assert shard_files(out) == before_files
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    Manifest.load(out)
    # The next good build cleans up whatever the crashed one left beside the dataset.
    build(corpus, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]
    assert shard_files(out) == before_files


def test_manifest_load_without_manifest(tmp_path):
    with pytest.raises(ShardError, match="pretrain-data build"):
        Manifest.load(tmp_path)


def test_manifest_load_rejects_invalid_manifest(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path)
    (copy / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match="not a valid manifest"):
        Manifest.load(copy)


def test_manifest_load_rejects_flipped_byte(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path)
    name = dataset[1]["splits"]["train"]["shards"][1]["name"]
    data = bytearray((copy / name).read_bytes())
    data[600] ^= 0xFF  # inside the first sample's text
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(ShardError, match=re.escape(name)):
        Manifest.load(copy)
    # Same size, so only the checksum catches it.
    Manifest.load(copy, verify_checksums=False)


def test_manifest_load_rejects_truncated_shard(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path)
    name = dataset[1]["splits"]["validation"]["shards"][0]["name"]
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[: len(data) // 2])
    for verify in (True, False):
        with pytest.raises(ShardError, match=re.escape(name)):
            Manifest.load(copy, verify_checksums=verify)


def test_manifest_load_rejects_missing_shard(dataset, tmp_path):
    copy = copy_dataset(dataset, tmp_path)
    name = dataset[1]["splits"]["train"]["shards"][-1]["name"]
    (copy / name).unlink()
    with pytest.raises(ShardError, match=re.escape(name) + ".*missing"):
        Manifest.load(copy, verify_checksums=False)


def test_manifest_shards_of_empty_split(corpus, tmp_path):
    build(corpus, tmp_path / "shards", BuildSettings(0.0, 4, 4096))
    manifest = Manifest.load(tmp_path / "shards")
    assert manifest.urls("train")
    with pytest.raises(ShardError, match="validation"):
        manifest.urls("validation")


def test_read_source_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CorpusError, match="nowhere"):
        read_source(str(missing))


def test_a_text_file_is_one_document_and_a_binary_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    (document,) = read_source(str(path))
    assert document.source_id == f"{tmp_path.name}:notes.txt" and document.texts == {"txt": "hello"}
    archive = tmp_path / "notes.gz"
    archive.write_bytes(b"\x1f\x8b\x08\x00" + bytes(60))
    with pytest.raises(CorpusError, match=r"notes\.gz \(gzip\)"):
        read_source(str(archive))


def test_read_text_files_source_ids_and_undecodable(corpus):
    documents = list(read_source(str(corpus)))
    by_id = {d.source_id: d for d in documents}
    assert len(documents) == len(by_id) == len([p for p in corpus.rglob("*") if p.is_file()])
    assert by_id["texts:latin1.txt"].texts is None
    assert by_id["texts:sub/nested.txt"].texts == {"txt": "\n\nnested cafe\u0301 file  \n\n"}
    assert [d.source_id for d in documents] == sorted(d.source_id for d in documents)


def test_empty_corpus_is_an_error(tmp_path):
    corpus = tmp_path / "empty_corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"")
    (corpus / "b.txt").write_bytes(b"\n \n")
    with pytest.raises(ShardError, match="no training documents"):
        build(corpus, tmp_path / "shards")
    assert not (tmp_path / "shards").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty_corpus"]


def test_build_settings_validation():
    with pytest.raises(ShardError):
        BuildSettings(validation_fraction=1.0)
    with pytest.raises(ShardError):
        BuildSettings(max_shard_samples=0)
    with pytest.raises(ShardError):
        BuildSettings(max_shard_bytes=0)


def test_normalize():
    assert normalize("\n\n  a\r\nb\rc \t\n\n") == "  a\nb\nc"
    assert normalize("cafe\u0301") == "caf\u00e9"
    assert normalize(" \n\t") == ""


def test_jsonl_reader(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": "first"}), "", json.dumps({"body": "second", "text": "ignored"}), "  "]
    lines.append(json.dumps({"text": "thïrd 🙂"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert list(read_source(str(path))) == [
        Document("corpus.jsonl:1", {"txt": "first"}),
        Document("corpus.jsonl:3", {"txt": "ignored"}),
        Document("corpus.jsonl:5", {"txt": "thïrd 🙂"}),
    ]
    with pytest.raises(CorpusError, match=r"corpus\.jsonl:1\b"):
        list(read_source(str(path), {"txt": "body"}))
    # A directory holding .jsonl files is read as jsonl.
    assert [d.texts for d in read_source(str(tmp_path))] == [{"txt": t} for t in ("first", "ignored", "thïrd 🙂")]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok too"}\n{"text": unquoted}\n', encoding="utf-8")
    documents = read_jsonl(path)
    assert next(documents).texts == {"txt": "ok"}
    assert next(documents).texts == {"txt": "ok too"}
    with pytest.raises(CorpusError, match=r"broken\.jsonl:3\b"):
        next(documents)
    path.write_text('{"text": "ok"}\n["a list"]\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2\b"):
        list(read_jsonl(path))


def test_build_from_jsonl(tmp_path):
    path = tmp_path / "corpus.jsonl"
    rng = random.Random(1)
    texts = [make_text(rng, n) for n in range(12)]
    path.write_text("\n".join(json.dumps({"text": t}) for t in [*texts, texts[0], ""]) + "\n", encoding="utf-8")
    manifest = build_shards(read_source(str(path)), tmp_path / "shards", [str(path)], SETTINGS, show_progress=False)
    assert manifest["dedup"]["exact_duplicates_dropped"] == 1
    assert manifest["dedup"]["empty_dropped"] == 1
    loaded = Manifest.load(tmp_path / "shards")
    urls = [str(tmp_path / "shards" / shard.name) for shards in loaded.splits.values() for shard in shards]
    stored = [sample["txt"].decode() for url in urls for sample in read_shard(url)]
    assert sorted(stored) == sorted(normalize(t) for t in texts)


def test_cli_build(corpus, dataset, tmp_path, capsys):
    out = tmp_path / "cli_shards"
    argv = ["build", "--source", str(corpus), "--out", str(out), "--quiet"]
    argv += ["--validation-fraction", "0.3", "--shard-samples", "4", "--shard-bytes", "4096"]
    cli_main(argv)
    manifest = Manifest.load(out)
    assert manifest.version == dataset[1]["version"]
    assert shard_files(out) == shard_files(dataset[0])
    printed = capsys.readouterr().out
    assert f"version {manifest.version}" in printed
    assert "dropped 2 duplicates, 2 empty, 1 not UTF-8" in printed
    assert printed.splitlines()[-1] == f"train on it: pretrain data.dir={out.resolve()}"  # the next step


def test_cli_build_missing_source(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["build", "--source", str(missing), "--out", str(tmp_path / "out"), "--quiet"])
    assert str(missing) in str(exit_info.value.code)
    assert "pretrain-data build" in str(exit_info.value.code)
    assert not (tmp_path / "out").exists()


def test_build_refuses_a_non_shard_directory_and_keeps_a_trained_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number in range(8):
        (corpus / f"doc{number}.txt").write_text(f"document number {number}\n" * 20)
    unrelated = tmp_path / "mixed"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(ShardError, match=r"not empty and holds no manifest\.json"):
        build_shards(read_source(str(corpus)), unrelated, [str(corpus)], show_progress=False)
    assert (unrelated / "notes.txt").read_text() == "keep me"

    out = tmp_path / "shards"
    build_shards(read_source(str(corpus)), out, [str(corpus)], show_progress=False)
    (out / "tokenizer.json").write_text("{}")
    build_shards(read_source(str(corpus)), out, [str(corpus)], show_progress=False)
    assert (out / "tokenizer.json").read_text() == "{}"


def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2 "):
        list(read_source(str(corpus)))


def test_a_full_disk_during_a_build_leaves_the_previous_dataset_and_says_so(corpus, tmp_path):
    out = tmp_path / "shards"
    build(corpus, out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def full_disk() -> None:  # in the child: files cannot grow past 4 kB, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    command = [str(Path(sys.executable).parent / "pretrain-data"), "build", "--source", str(corpus), "--out", str(out)]
    failed = subprocess.run([*command, "--quiet"], capture_output=True, text=True, preexec_fn=full_disk, timeout=120)
    assert failed.returncode == 1
    assert f"writing the shards failed: [Errno 27] File too large; {out} is unchanged" in failed.stderr
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["shards"]  # no staging directory left


def split_texts(out: Path) -> dict[str, dict[str, str]]:
    """Each split's texts by source id, read back from the shards."""
    manifest = Manifest.load(out)
    return {
        split: {
            json.loads(sample["json"])["source_id"]: sample["txt"].decode()
            for url in manifest.urls(split)
            for sample in read_shard(url)
        }
        for split in SPLITS
    }


def test_validation_sources_are_the_validation_split(tmp_path):
    corpus, held_out = tmp_path / "corpus", tmp_path / "held_out"
    corpus.mkdir(), held_out.mkdir()
    for number in range(6):
        (corpus / f"doc{number}.txt").write_text(f"training document {number}\n" * 5)
    (held_out / "fresh.txt").write_text("a validation document\n")
    (held_out / "copy.txt").write_text("training document 3\n" * 5)  # seen in training: dropped
    out = tmp_path / "shards"
    cli_main(["build", "--source", str(corpus), "--validation-source", str(held_out), "--out", str(out), "--quiet"])
    texts = split_texts(out)
    assert set(texts["validation"]) == {"held_out:fresh.txt"}
    assert len(texts["train"]) == 6 and all(key.startswith("corpus:") for key in texts["train"])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["settings"]["validation_sources"] == [str(held_out)]
    assert manifest["settings"]["validation_fraction"] == 0.0
    assert manifest["split_rule"] == "validation iff the document was read from validation_sources"
    assert manifest["dedup"]["exact_duplicates_dropped"] == 1


def test_a_validation_tail_holds_out_the_end_of_every_document(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [f"line {number:02d} of the book" for number in range(40)]
    (corpus / "book.txt").write_text("\n".join(lines) + "\n")
    (corpus / "short.txt").write_text("one line only")  # no line starts in its tail: whole, in training
    out = tmp_path / "shards"
    cli_main(["build", "--source", str(corpus), "--validation-tail", "0.25", "--out", str(out), "--quiet"])
    texts = split_texts(out)
    head, tail = texts["train"]["corpus:book.txt"], texts["validation"]["corpus:book.txt#tail"]
    assert head + "\n" + tail == normalize("\n".join(lines))
    assert tail.startswith("line ") and tail.splitlines() == lines[-len(tail.splitlines()) :]
    assert 0.22 < len(tail) / len(head + "\n" + tail) <= 0.25  # from the first line start in the last 25%
    assert texts["train"]["corpus:short.txt"] == "one line only" and len(texts["validation"]) == 1
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["settings"]["validation_tail"] == 0.25 and "#tail" in manifest["split_rule"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--validation-fraction", "0.1", "--validation-tail", "0.1"], "--validation-fraction and --validation-tail"),
        (["--validation-source", "x", "--validation-tail", "0.1"], "--validation-source and --validation-tail"),
        (["--validation-tail", "1.5"], r"--validation-tail 1\.5 must be in \(0, 1\)"),
        (["--pairs", "--validation-tail", "0.1"], "cuts the text of documents, not pairs"),
    ],
)
def test_one_way_of_choosing_validation(tmp_path, flags, message):
    with pytest.raises(SystemExit, match=message):
        cli_main(["build", "--source", "stdlib", *flags, "--out", str(tmp_path / "out"), "--quiet"])
    assert not (tmp_path / "out").exists()


def test_tail_parts_are_normalised_and_deduplicated(tmp_path):
    """Each part is normalised as a whole document is, and a tail repeating a text kept before is dropped."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    footer = "\n".join(f"footer line {n}" for n in range(4))
    for name in ("a", "b"):  # two documents sharing their last quarter
        body = "\n".join(f"{name} line {n}   " for n in range(12))
        (corpus / f"{name}.txt").write_text(body + "\n\n\n" + footer)
    out = tmp_path / "shards"
    cli_main(["build", "--source", str(corpus), "--validation-tail", "0.25", "--out", str(out), "--quiet"])
    texts = split_texts(out)
    (tail,) = texts["validation"].values()  # b's tail, the same end of the footer as a's, was dropped
    assert footer.endswith(tail) and tail.startswith("footer line")
    assert all(text == normalize(text) for split in texts.values() for text in split.values())
    assert json.loads((out / MANIFEST).read_text())["dedup"]["exact_duplicates_dropped"] == 1


@pytest.mark.parametrize("suffix", [".json", ".csv", ".tsv"])
def test_a_record_file_of_another_format_is_not_read_as_text(tmp_path, suffix):
    path = tmp_path / f"corpus{suffix}"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(CorpusError, match=rf"is a \{suffix} file.*name JSON Lines \.jsonl"):
        read_source(str(path))
