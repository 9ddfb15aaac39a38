"""`pretrain-data index`: shards written elsewhere (by webdataset's TarWriter, by GNU tar), named by
directory, glob, brace list or `pipe:` command, indexed where they are, then read and trained on
(text under any field, or a key of the .json member), resumed bitwise after a kill; and every bad
input refused with a message naming it and the fix."""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import lzma
import re
import subprocess
import tarfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import webdataset as wds

from conftest import tiny_run
from pretraining.cli import data as pretrain_data
from pretraining.data.corpus import stdlib_root
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import PackedBlocks
from pretraining.data.manifest import MANIFEST, Manifest
from pretraining.data.reader import SampleReader
from pretraining.data.stream import Cursor, ShardStream
from pretraining.data.tokenizer import ByteTokenizer, Tokenizer
from pretraining.errors import ShardError
from pretraining.files import sha256_of
from test_resume import RESUMABLE, kill_twice_and_compare

SOURCE = (stdlib_root() / "json" / "decoder.py").read_text()
TEXTS = [SOURCE[i * 300 : (i + 1) * 300] for i in range(24)]


def tarwriter_shards(directory: Path, per_shard: int = 3) -> list[Path]:
    """`TEXTS` in shards written by webdataset's own writer: text in `.txt` and in `.json` (`text`)."""
    directory.mkdir(parents=True)
    paths = []
    for shard, start in enumerate(range(0, len(TEXTS), per_shard)):
        paths.append(directory / f"shard-{shard:06d}.tar")
        with wds.TarWriter(str(paths[-1])) as writer:
            for number in range(start, start + per_shard):
                text = TEXTS[number]
                writer.write({"__key__": f"doc{number:03d}", "txt": text, "json": {"text": text, "n": number}})
    return paths


def index(*arguments: str) -> None:
    pretrain_data(["index", *arguments, "--quiet"])


def datamodule(directory: Path | str, trust_pipe_commands: bool = False, **format: str) -> ShardDataModule:
    blocks: Callable[[Tokenizer], PackedBlocks] = partial(PackedBlocks, block_size=32, **format)
    return ShardDataModule(
        str(directory), ByteTokenizer(), blocks, global_batch_size=4, streams=1, trust_pipe_commands=trust_pipe_commands
    )


def training_texts(manifest: Manifest, field: str) -> list[str]:
    return [text for (text,) in SampleReader([field], "raise").all_texts(manifest.urls("train"))]


def test_tarwriter_shards_are_indexed_in_place_and_read_as_written(tmp_path: Path, capsys) -> None:
    paths = tarwriter_shards(tmp_path / "shards")
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "index"))
    printed = capsys.readouterr().out
    manifest = Manifest.load(tmp_path / "index")
    assert manifest.fields == ("json", "json:text", "txt")  # `n` is a number, not a text field
    assert "fields of every sample: json, json:text, txt" in printed
    assert f"pretrain data.dir={tmp_path / 'index'} data.format.text_field=" not in printed  # txt is read as is
    train, validation = manifest.shards("train"), manifest.shards("validation")
    assert len(train) == 6 and len(validation) == 2 and all(shard.samples == 3 for shard in train + validation)
    # The shards stay where they are, named by absolute path, with their real size and checksum.
    by_path = {Path(shard.name): shard for shard in train + validation}
    assert set(by_path) == set(paths)
    assert all(by_path[p].sha256 == sha256_of(p) and by_path[p].bytes == p.stat().st_size for p in paths)
    # Every text of the training shards, from either field, is read as written.
    held_out = {
        int(json.loads(s["json"])["n"])
        for url in manifest.urls("validation")
        for s in wds.WebDataset(url, shardshuffle=False)
    }
    expected = sorted(TEXTS[n] for n in range(len(TEXTS)) if n not in held_out)
    assert sorted(training_texts(manifest, "txt")) == expected == sorted(training_texts(manifest, "json:text"))
    # Indexing the unchanged set again gives the same version; changing a shard gives another.
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "again"))
    assert Manifest.load(tmp_path / "again").version == manifest.version
    tarwriter_shards(tmp_path / "changed")
    (tmp_path / "changed" / "shard-000000.tar").write_bytes(paths[1].read_bytes())
    index(str(tmp_path / "changed"), "--validation-fraction", "0.25", "--out", str(tmp_path / "changed"))
    changed = Manifest.load(tmp_path / "changed")
    assert changed.version != manifest.version
    assert changed.shards("train")[0].name.startswith("shard-")  # under the manifest's directory: relative


def test_a_datamodule_reads_the_field_the_config_names(tmp_path: Path) -> None:
    tarwriter_shards(tmp_path / "shards")
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "shards"))
    assert datamodule(tmp_path / "shards", text_field="json:text").validation_sets[0]
    with pytest.raises(ShardError) as refused:
        datamodule(tmp_path / "shards", text_field="text")
    message = str(refused.value)
    assert "data.format.text_field='text': not a field of every sample" in message
    assert "json, json:text, txt" in message and "json:<key>" in message


def test_gnu_tar_shards_keys_with_dots_and_directories(tmp_path: Path, capsys) -> None:
    """WebDataset's rule, which the reader follows: the key is the member's path up to the first dot of its
    file name, so dots in directories stay in the key, and a dot in a file's stem starts its field."""
    for part in range(3):
        directory = tmp_path / "src" / f"part{part}" / "v1.2"
        directory.mkdir(parents=True)
        for number in range(4):
            (directory / f"file{number}.txt").write_text(TEXTS[part * 4 + number])
        subprocess.run(
            ["tar", "cf", str(tmp_path / f"gnu-{part}.tar"), f"part{part}"], cwd=tmp_path / "src", check=True
        )
    index(str(tmp_path / "gnu-{0..1}.tar"), "--validation", str(tmp_path / "gnu-2.tar"), "--out", str(tmp_path / "i"))
    manifest = Manifest.load(tmp_path / "i")
    assert manifest.fields == ("txt",) and [s.samples for s in manifest.shards("train")] == [4, 4]
    keys = [sample["__key__"] for sample in wds.WebDataset(manifest.urls("train")[0], shardshuffle=False)]
    assert sorted(keys) == [f"part0/v1.2/file{n}" for n in range(4)]
    assert sorted(training_texts(manifest, "txt")) == sorted(TEXTS[:8])
    # A dot in a file's stem: `notes.final.txt` is key `notes`, field `final.txt`, which only one sample has.
    (tmp_path / "src" / "part0" / "notes.final.txt").write_text(TEXTS[20])
    subprocess.run(["tar", "cf", str(tmp_path / "gnu-0.tar"), "part0"], cwd=tmp_path / "src", check=True)
    index(str(tmp_path / "gnu-{0..1}.tar"), "--validation", str(tmp_path / "gnu-2.tar"), "--out", str(tmp_path / "i"))
    assert "of some: final.txt (1), txt (12)" in capsys.readouterr().out
    with pytest.raises(ShardError, match=r"text_field='txt': not a field of every sample.*txt is in 12 only"):
        datamodule(tmp_path / "i")


def test_a_pipe_brace_list_is_indexed_read_and_checked_through_the_command(tmp_path: Path) -> None:
    tarwriter_shards(tmp_path / "shards")
    spec = f"pipe:cat {tmp_path}/shards/shard-{{000000..000007}}.tar"
    index(spec, "--validation-fraction", "0.25", "--out", str(tmp_path / "plain"))
    plain = Manifest.load(tmp_path / "plain", trust_pipe_commands=True)
    names = [shard.name for shard in plain.shards("train") + plain.shards("validation")]
    assert sorted(names) == [f"pipe:cat {tmp_path}/shards/shard-{n:06d}.tar" for n in range(8)]
    assert all(shard.sha256 is None for shard in plain.shards("train"))  # remote: no checksum unless asked
    index(spec, "--validation-fraction", "0.25", "--out", str(tmp_path / "summed"), "--remote-checksums")
    summed = Manifest.load(tmp_path / "summed", trust_pipe_commands=True)
    assert [s.sha256 for s in summed.shards("train")] == [
        sha256_of(Path(s.name.split()[-1])) for s in summed.shards("train")
    ]
    assert sorted(training_texts(summed, "txt")) == sorted(training_texts(plain, "txt"))
    assert summed.problems() == {}
    # At start-up a remote checksum is checked by reading the shard through its command.
    altered = summed.shards("train")[0].name.split()[-1]
    Path(altered).write_bytes(Path(altered).read_bytes().replace(b"import", b"IMPORT"))
    assert "altered or corrupt" in summed.problems()[summed.shards("train")[0].name]
    assert plain.problems() == {}  # without a checksum, only reading tells (the reader counts samples)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{tmp}/nothing", "--validation-fraction", "0.5"], r"nothing does not exist"),
        (["{tmp}/shards/*.tgz", "--validation-fraction", "0.5"], r"\*\.tgz matches no file"),
        (["{tmp}", "--validation-fraction", "0.5"], r"holds no shards"),
        (["{tmp}/shards"], r"name the validation shards with --validation"),
        (["{tmp}/shards", "--validation-fraction", "0.99"], r"leaves none for training"),
        (
            ["pipe:cat {tmp}/none-{0..1}.tar", "--validation-fraction", "0.5"],
            r"none-0.tar cannot .*exited with status 1",
        ),
        (["{tmp}/shards", "--validation-fraction", "0.5", "--workers", "0"], r"--workers=0 must be at least 1"),
        (
            ["{tmp}/shards", "--validation", "{tmp}/shards/shard-000000.tar"],
            r"shard-000000\.tar is named twice",
        ),
        (
            ["{tmp}/shards", "--validation", "x.tar", "--validation-fraction", "0.1"],
            r"give --validation or --validation-fraction, not both",
        ),
        (
            ["{tmp}/shards/shard-00000{0,1,2}.tar", "--validation-fraction", "0.3"],
            r"shard-000002\.tar cannot be read past byte",
        ),
    ],
)
def test_bad_index_inputs_are_refused_naming_the_fix(tmp_path: Path, capsys, arguments, message) -> None:
    paths = tarwriter_shards(tmp_path / "shards")
    paths[2].write_bytes(paths[2].read_bytes()[:2000])  # cut inside its second sample
    with pytest.raises(SystemExit) as refused:
        index(*[a.replace("{tmp}", str(tmp_path)) for a in arguments], "--out", str(tmp_path / "out"))
    error = str(refused.value.code)
    assert error.startswith("pretrain-data index: error: ") and "Traceback" not in capsys.readouterr().err
    assert re.search(message, error), error
    assert not (tmp_path / "out" / MANIFEST).exists()


@pytest.mark.parametrize(
    ("pointing_at", "message"),
    [
        (
            "pipe:cat {tmp}/shards/shard-{{000000..000003}}.tar",
            r"names shards, not a directory of shards: .*pretrain-data index",
        ),
        ("{tmp}/shards", r"holds 8 tar files but no manifest\.json: .*pretrain-data index .* --out"),
    ],
)
def test_data_dir_at_shards_without_a_manifest_points_to_the_index(tmp_path: Path, pointing_at, message) -> None:
    tarwriter_shards(tmp_path / "shards")
    with pytest.raises(ShardError, match=message):
        datamodule(pointing_at.format(tmp=tmp_path))


@pytest.mark.slow  # three runs; tests/test_resume.py's next-token kill stays in the fast suite
def test_kill_and_resume_on_an_indexed_pipe_set_is_bitwise_exact(tmp_path: Path) -> None:
    tarwriter_shards(tmp_path / "shards")
    spec = f"pipe:cat {tmp_path}/shards/shard-{{000000..000007}}.tar"
    index(spec, "--validation-fraction", "0.25", "--out", str(tmp_path / "index"))
    overrides = [
        *tiny_run("clm_tiny"),
        *RESUMABLE,
        f"data.dir={tmp_path / 'index'}",
        "data.format.text_field=json:text",
        "data.trust_pipe_commands=true",
    ]
    kill_twice_and_compare(tmp_path / "logs", overrides, kills=(10,), max_steps=12)


def test_a_tokenizer_trains_on_the_field_named(tmp_path: Path, capsys) -> None:
    tarwriter_shards(tmp_path / "shards")
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "shards"))
    pretrain_data(["tokenizer", "--data", str(tmp_path / "shards"), "--field", "json:text", "--vocab-size", "300"])
    assert "vocabulary 300" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        pretrain_data(["tokenizer", "--data", str(tmp_path / "shards"), "--field", "text", "--quiet"])
    assert "--field='text': not a field of every sample" in str(refused.value.code)
    assert "json, json:text, txt: name one of those" in str(refused.value.code)


def test_a_manifest_runs_no_command_it_names_unless_trusted(tmp_path: Path) -> None:
    """A manifest is a file, perhaps from elsewhere: its `pipe:` shards run only when the user allows them."""
    tarwriter_shards(tmp_path / "shards")
    ran = tmp_path / "ran"
    spec = f"pipe:touch {ran}; cat {tmp_path}/shards/shard-{{000000..000003}}.tar"
    index(spec, "--validation-fraction", "0.25", "--out", str(tmp_path / "index"))
    ran.unlink()  # the index ran it: the user typed it
    with pytest.raises(ShardError, match=r"running shell commands .* allow them with data.trust_pipe_commands=true$"):
        datamodule(tmp_path / "index")
    with pytest.raises(SystemExit, match=r"running shell commands .* allow them with --trust-pipe-commands$"):
        pretrain_data(["tokenizer", "--data", str(tmp_path / "index"), "--quiet"])
    assert not ran.exists()
    assert datamodule(tmp_path / "index", trust_pipe_commands=True).validation_sets[0] and ran.exists()


def test_a_build_never_replaces_a_directory_of_indexed_shards(tmp_path: Path) -> None:
    paths = tarwriter_shards(tmp_path / "shards")
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "shards"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(TEXTS[0])
    with pytest.raises(SystemExit, match=r"holds the manifest of shards indexed .* choose a new or empty --out"):
        pretrain_data(["build", "--source", str(tmp_path / "texts"), "--out", str(tmp_path / "shards"), "--quiet"])
    assert all(path.exists() for path in paths)
    assert Manifest.load(tmp_path / "shards").fields == ("json", "json:text", "txt")


@pytest.mark.parametrize("compress", [gzip.compress, bz2.compress, lzma.compress], ids=["gzip", "bzip2", "xz"])
def test_a_compressed_shard_with_a_damaged_header_is_refused_not_cut_short(tmp_path: Path, compress) -> None:
    """tarfile ends a compressed archive silently at a damaged header too; the reader decompresses it
    itself, so what follows the end is checked as for a plain tar."""
    path = tarwriter_shards(tmp_path / "shards", per_shard=len(TEXTS))[0]
    data = bytearray(path.read_bytes())
    with tarfile.open(path) as tar:
        headers = [member.offset for member in tar]
    data[headers[10] : headers[10] + 100] = b"X" * 100  # the name of the sixth sample's first member
    (tmp_path / "bad.tar.z").write_bytes(compress(bytes(data)))
    (tmp_path / "good.tar.z").write_bytes(compress(path.read_bytes()))
    index(str(tmp_path / "good.tar.z"), "--validation", str(path), "--out", str(tmp_path / "x"))
    assert Manifest.load(tmp_path / "x").shards("train")[0].samples == len(TEXTS)
    with pytest.raises(SystemExit, match=rf"bad\.tar\.z cannot be read past byte {headers[10]}: HeaderError"):
        index(str(tmp_path / "bad.tar.z"), "--validation", str(path), "--out", str(tmp_path / "i"))
    reader = SampleReader(["txt"], "skip")
    with pytest.warns(UserWarning, match=r"cannot be read past byte"):
        assert len(list(reader.texts(str(tmp_path / "bad.tar.z"), len(TEXTS)))) == 5
    assert reader.take() == (len(TEXTS), len(TEXTS) - 5)


def test_changing_the_field_read_changes_the_topology_a_resume_compares(tmp_path: Path) -> None:
    tarwriter_shards(tmp_path / "shards")
    index(str(tmp_path / "shards"), "--validation-fraction", "0.25", "--out", str(tmp_path / "shards"))
    txt, json_text = datamodule(tmp_path / "shards"), datamodule(tmp_path / "shards", text_field="json:text")
    assert txt.topology != json_text.topology and txt.topology["text_field"] == "txt"


def test_an_empty_file_is_reported_by_the_index_and_counted_once_by_training(tmp_path: Path, capsys) -> None:
    """GNU tar shards holding an empty file (an empty `__init__.py` is common): the index says how many
    samples training will skip, and training counts the sample once, though four streams read its shard."""
    for part in range(3):
        (tmp_path / "src" / f"part{part}").mkdir(parents=True)
        for number in range(8):
            (tmp_path / "src" / f"part{part}" / f"file{number}.txt").write_text(TEXTS[part * 8 + number])
    (tmp_path / "src" / "part0" / "empty.txt").write_text("")
    for part in range(3):
        tar = ["tar", "--format=gnu", "-cf", str(tmp_path / f"gnu-{part}.tar"), f"part{part}"]
        subprocess.run(tar, cwd=tmp_path / "src", check=True)
    index(str(tmp_path / "gnu-{0..1}.tar"), "--validation", str(tmp_path / "gnu-2.tar"), "--out", str(tmp_path / "i"))
    assert "warning: 1 of 25 samples (4.00%) have an empty or undecodable txt" in capsys.readouterr().out
    manifest = Manifest.load(tmp_path / "i")
    urls, samples = manifest.urls("train"), [shard.samples for shard in manifest.shards("train")]
    stream = ShardStream(urls, PackedBlocks(ByteTokenizer(), 32), seed=0, samples=samples)
    skipped = 0
    with pytest.warns(UserWarning, match=r"part0/empty'.*'txt' is empty"):
        for number in range(8):  # 8 streams over 2 shards: each stream's first shard is one of epochs 0 to 3
            first_shard = itertools.takewhile(lambda e: e.cursor.shard == 0, stream.examples(number, 8, Cursor()))
            skipped += sum(example.skipped for example in first_shard)
    assert skipped == 1
