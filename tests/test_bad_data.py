"""Bad data: corrupt, truncated and missing shards, unusable samples, too few shards. With
`data.bad_data=skip` (the default) they are skipped, named in a warning and counted, the run
stops once more than `data.max_skip_fraction` was skipped, and the exact resume holds; with
`raise` the first one stops the run. A fuzz test mutates shards at random, another damages every
tar header of a shard in turn."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import random
import signal
import tarfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import ComposeTrain, packed_blocks, tiny_run
from pretraining.checkpoint import saved_checkpoints, verify
from pretraining.data.corpus import Document, stdlib_root
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.formats import PackedBlocks
from pretraining.data.manifest import MANIFEST, TEXT_FIELDS, Manifest
from pretraining.data.reader import SampleReader, ShardReadError, read_shard
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.sources import check_skips
from pretraining.data.stream import Cursor, ShardStream, stream_shard
from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import ShardError
from pretraining.files import sha256_of
from pretraining.train import train
from test_resume import RESUMABLE, kill_twice_and_compare, run_dir

SHARD_SAMPLES = 5
BAD_SAMPLES = [  # each an unusable sample: named, skipped and counted
    {"json": b"{}"},  # no text field
    {"txt": b"caf\xe9 au lait", "json": b"{}"},  # not UTF-8
    {"txt": b"  \n ", "json": b"{}"},  # empty
]


def tar_of(samples: list[dict[str, bytes]], prefix: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for number, sample in enumerate(samples):
            for field, data in sample.items():
                info = tarfile.TarInfo(f"{prefix}-{number:04d}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def replace_shard(directory: Path, name: str, data: bytes, samples: int | None = None) -> None:
    """Write `data` as shard `name` and record its size and checksum (and sample count) in the manifest,
    as shards written by another tool would be: only reading them shows what is wrong."""
    (directory / name).write_bytes(data)
    manifest = json.loads((directory / MANIFEST).read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if shard["name"] == name:
                shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
                shard["samples"] = shard["samples"] if samples is None else samples
    (directory / MANIFEST).write_text(json.dumps(manifest))


def build_text_shards(out: Path, documents: int = 50, shard_samples: int = SHARD_SAMPLES) -> Manifest:
    """Shards of `shard_samples` documents of 200 characters each (a tenth of them for validation; the text repeats,
    so all of them are kept, not left out as training text)."""
    source = (stdlib_root() / "json" / "decoder.py").read_text() * 3
    docs = [Document(f"doc{i}", {"txt": source[i * 200 : (i + 1) * 200]}) for i in range(documents)]
    settings = BuildSettings(0.1, max_shard_samples=shard_samples, decontaminate=None)
    build_shards(docs, out, ["json/decoder.py"], settings, False)
    return Manifest.load(out)


def tar_members(tar: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(tar)) as opened:
        return opened.getmembers()


def member_offset(tar: bytes, prefix: str) -> int:
    """The offset of the header of the first member of `tar` whose name starts with `prefix`."""
    return next(member.offset for member in tar_members(tar) if member.name.startswith(prefix))


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text shards in which every training shard holds the three unusable samples among its good ones,
    and the second is cut short in its sixth sample (its manifest entry still counting all of them)."""
    out = tmp_path_factory.mktemp("data") / "bad"
    manifest = build_text_shards(out)
    for number, url in enumerate(manifest.urls("train")):
        good = [{k: v for k, v in s.items() if not k.startswith("__")} for s in read_shard(url)]
        samples = good[:2] + BAD_SAMPLES + good[2:]
        data = tar_of(samples, Path(url).stem)
        if number == 1:
            data = data[: member_offset(data, f"{Path(url).stem}-0005") + 700]  # inside sample 5's first member
        replace_shard(out, Path(url).name, data, len(samples))
    return out


def test_a_truncated_shard_yields_its_whole_samples_then_names_its_offset(bad_shards: Path) -> None:
    url = Manifest.load(bad_shards).urls("train")[1]
    seen = []
    with pytest.raises(ShardReadError, match=rf"{url} cannot be read past byte \d+: ReadError"):
        seen.extend(read_shard(url))
    assert [sample["__key__"] for sample in seen] == [f"train-000001-{n:04d}" for n in range(5)]
    assert seen[1]["__offset__"] == 2 * 1024  # a good sample: two members of one header and one data block


def test_skip_counts_every_sample_read_and_lost_and_names_shard_and_offset(bad_shards: Path) -> None:
    urls = Manifest.load(bad_shards).urls("train")
    reader = SampleReader(TEXT_FIELDS, "skip")
    with pytest.warns(UserWarning) as caught:
        texts = list(reader.texts(urls[0], 8)) + list(reader.texts(urls[1], 8))
    assert len(texts) == 5 + 2  # the first shard's good samples, the second's before the cut
    assert reader.take() == (16, 9)  # 8 read in each; 3 unusable, then 3 unusable + 3 lost to the cut
    messages = [str(w.message) for w in caught]
    assert any(f"sample 'train-000000-0002' of {urls[0]} at byte 4096: no 'txt' field" in m for m in messages)
    assert any("'train-000000-0003'" in m and "'txt' is not UTF-8" in m for m in messages)
    assert any("'train-000000-0004'" in m and "'txt' is empty" in m for m in messages)
    assert any(f"{urls[1]} cannot be read past byte" in m and "about 3 samples lost" in m for m in messages)


def test_raise_stops_on_the_first_bad_sample_with_the_fix(bad_shards: Path) -> None:
    url = Manifest.load(bad_shards).urls("train")[0]
    reader = SampleReader(TEXT_FIELDS, "raise")
    texts = reader.texts(url, 8)
    assert len([next(texts), next(texts)]) == 2
    with pytest.raises(ShardError, match=r"'train-000000-0002' .* no 'txt' field.*set data.bad_data=skip"):
        next(texts)


def test_a_shard_refused_at_start_keeps_its_place_and_is_skipped_whole(tmp_path: Path) -> None:
    manifest = build_text_shards(tmp_path / "shards")
    urls, format = manifest.urls("train"), PackedBlocks(ByteTokenizer(), 32)
    samples = [shard.samples for shard in manifest.shards("train")]
    full = ShardStream(urls, format, seed=3, samples=samples)
    refused = ShardStream(urls, format, seed=3, samples=samples, refused={2: "missing"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else is skipped
        reference = list(take(full.examples(0, 1, Cursor()), 200))
    with pytest.warns(UserWarning, match=rf"skipped shard {urls[2]}: missing \(5 samples\)"):
        skipped = list(take(refused.examples(0, 1, Cursor()), 600))
    # The other shards' examples, in the same order and at the same cursors: the position arithmetic holds.
    refused_ordinals = {k for k in range(100) if stream_shard(k, 0, 1, len(urls), 3)[1] == 2}
    kept = [(e.cursor, e.example) for e in reference if e.cursor.shard not in refused_ordinals]
    assert [(e.cursor, e.example) for e in skipped][: len(kept)] == kept
    assert not {e.cursor.shard for e in skipped} & refused_ordinals
    # Read in several epochs, the refused shard's samples count once: the skipped share does not grow.
    assert max(e.cursor.shard for e in skipped) > sorted(refused_ordinals)[1]
    assert sum(e.skipped for e in skipped) == 5 and sum(e.skipped for e in reference) == 0


def take(examples: Iterator, count: int) -> Iterator:
    return (example for example, _ in zip(examples, range(count), strict=False))


# --- fuzzing ----------------------------------------------------------------------------------------------


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail, instead of hanging, if the block runs longer than `seconds`."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"the shard reader ran past {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def mutated(data: bytes, rng: random.Random) -> bytes:
    """`data` truncated at a random byte, or with random bytes flipped, or both."""
    kind = rng.choice(("truncate", "flip", "both"))
    if kind != "flip":
        data = data[: rng.randrange(len(data))]
    if kind != "truncate" and data:
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 16)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        data = bytes(flipped)
    return data


def fuzz_shard_reader(tmp_path: Path, mutations: int, seed: int) -> None:
    """Every mutation of a real shard reads, under `skip`, without an exception, every sample read
    either used or counted as skipped; under `raise`, it reads the same texts until a `ShardError`."""
    manifest = build_text_shards(tmp_path / "shards", documents=10)
    original = (manifest.directory / manifest.shards("train")[0].name).read_bytes()
    rng, path = random.Random(seed), tmp_path / "mutated.tar"
    outcomes = set()
    with deadline(max(30, mutations // 10)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(mutations):
            path.write_bytes(mutated(original, rng))
            skipping = SampleReader(TEXT_FIELDS, "skip")
            texts = list(skipping.texts(str(path), SHARD_SAMPLES))
            read, skipped = skipping.take()
            assert read >= 1 and read - skipped == len(texts) and all(isinstance(t, str) for (t,) in texts)
            raising, strict = SampleReader(TEXT_FIELDS, "raise").texts(str(path), SHARD_SAMPLES), []
            try:
                strict.extend(raising)
            except ShardError as error:
                assert str(path) in str(error) and "data.bad_data=skip" in str(error)
                outcomes.add("raised")
            assert texts[: len(strict)] == strict and (skipped > 0 or strict == texts)
            outcomes.add("skipped" if skipped else "clean")
    assert outcomes == {"raised", "skipped", "clean"}  # the mutations reached every outcome


def test_fuzz_the_shard_reader(tmp_path: Path) -> None:
    fuzz_shard_reader(tmp_path, mutations=400, seed=0)


@pytest.mark.slow
def test_fuzz_the_shard_reader_longer(tmp_path: Path) -> None:
    fuzz_shard_reader(tmp_path, mutations=20_000, seed=1)


# --- header damage at every member boundary --------------------------------------------------------------


def overwritten(data: bytes, at: int, block: bytes) -> bytes:
    return data[:at] + block + data[at + len(block) :]


def flipped(data: bytes, at: int) -> bytes:
    """`data` with the lowest bit of byte `at` flipped (an octal digit stays one, a letter a letter)."""
    return overwritten(data, at, bytes([data[at] ^ 1]))


def closed_at(data: bytes, at: int) -> bytes:
    """`data` cut at byte `at` and closed as a tar ends (two zero blocks, padded to a record): a valid tar."""
    cut = data[:at] + bytes(2 * tarfile.BLOCKSIZE)
    return cut + bytes(-len(cut) % tarfile.RECORDSIZE)


CLOSED = "cut and closed"  # only the sample count against the manifest entry can tell it from a whole shard
HEADER_DAMAGE = {  # a tar header at byte `at` damaged: Python's tarfile stops at it, silently after the first
    "truncated at it": lambda data, at: data[:at],
    "truncated into it": lambda data, at: data[: at + 7],
    "zeroed": lambda data, at: overwritten(data, at, bytes(tarfile.BLOCKSIZE)),  # what tarfile takes for the end
    "checksum flipped": lambda data, at: flipped(data, at + 148),  # the chksum field's first octal digit
    "name flipped": lambda data, at: flipped(data, at),  # the checksum no longer matches
    "random bytes": lambda data, at: overwritten(data, at, random.Random(at).randbytes(tarfile.BLOCKSIZE)),
    CLOSED: closed_at,
}


def read_under(policy: str, path: Path) -> tuple[list[tuple[str, ...]], tuple[int, int], list[str], str | None]:
    """What `SampleReader` makes of shard `path` (of `SHARD_SAMPLES` samples) under `policy`: its texts,
    (read, skipped), its warnings, and the message of the `ShardError` that stopped it, if one did."""
    reader, texts, stopped = SampleReader(TEXT_FIELDS, policy), [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            texts.extend(reader.texts(str(path), SHARD_SAMPLES))
        except ShardError as error:
            stopped = str(error)
    return texts, reader.take(), [str(warning.message) for warning in caught], stopped


@pytest.fixture(scope="module")
def text_shard(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real shard of `SHARD_SAMPLES` samples, each a `.txt` and a `.json` member."""
    manifest = build_text_shards(tmp_path_factory.mktemp("data") / "text", documents=10)
    assert manifest.shards("train")[0].samples == SHARD_SAMPLES
    return (manifest.directory / manifest.shards("train")[0].name).read_bytes()


@pytest.mark.parametrize("damage", HEADER_DAMAGE)
def test_header_damage_at_every_member_boundary_is_skipped_and_counted_or_stops(
    text_shard: bytes, tmp_path: Path, damage: str
) -> None:
    """A shard damaged at the tar header of any of its members (the file cut there, the header zeroed,
    corrupt or random, or the tar cut there and closed) never ends silently: under `skip` it gives the
    texts read before the damage and counts the rest as skipped, naming the shard and where it failed;
    under `raise` it gives the same texts, then stops naming the shard and `data.bad_data=skip`."""
    path = tmp_path / "train-000000.tar"
    path.write_bytes(text_shard)
    reference, counts, messages, _ = read_under("skip", path)
    assert len(reference) == SHARD_SAMPLES and counts == (SHARD_SAMPLES, 0) and not messages  # the control
    members = tar_members(text_shard)
    assert [member.name.partition(".")[2] for member in members] == ["txt", "json"] * SHARD_SAMPLES
    with deadline(30):
        for index, member in enumerate(members):
            case = f"{damage} at the header of {member.name} (byte {member.offset})"
            key = member.name.partition(".")[0]
            seen = {m.name.partition(".")[0] for m in members[:index]}  # the samples with a member read
            whole = len(seen - {key})  # the samples whose members all lie before the damage
            # Damage at the header of a sample's `.json` (its second member) comes after its `.txt` was read
            # whole: `read_shard` yields that partial sample (the members it read), counted as read, and as
            # `TEXT_FIELDS` asks only for `txt`, `SampleReader` uses its text like any other.
            partial = key in seen
            expected = reference[: whole + partial]
            path.write_bytes(HEADER_DAMAGE[damage](text_shard, member.offset))
            texts, (read, skipped), messages, stopped = read_under("skip", path)
            assert stopped is None and texts == expected and read - skipped == len(texts), case
            strict, _, _, stopped = read_under("raise", path)
            assert strict == expected, case
            if damage == CLOSED:  # the tar ends cleanly: its sample count is short of the manifest entry's
                lost = SHARD_SAMPLES - len(seen)
                named = f"shard {path} holds {len(seen)} samples, its manifest entry {SHARD_SAMPLES}: cut short"
                if not lost:  # cut after the last sample's `.txt`: every sample there, no text lost
                    assert partial and index == len(members) - 1, case
                    continue
            else:  # tarfile ends at the damaged header, which the reader notices (a read error or `early_end`)
                lost = max(1, SHARD_SAMPLES - len(seen))  # the samples not seen, or one where all were
                named = f"{path} cannot be read past byte {member.offset}: "
                assert f"(about {lost} samples lost)" in messages[0], case
            assert skipped == lost and len(messages) == 1 and named in messages[0], case
            assert stopped is not None and named in stopped and "data.bad_data=skip" in stopped, case


def test_a_valid_shorter_tar_in_place_of_a_shard_is_caught_in_the_stream_by_its_sample_count(tmp_path: Path) -> None:
    """A shard replaced by a valid tar of fewer samples under its name (its size and sha256 rewritten in
    the manifest, so the start-up check passes it) is caught by its manifest entry's sample count as the
    stream reads it: `raise` stops naming both counts, `skip` counts the missing samples as skipped."""
    manifest = build_text_shards(tmp_path / "shards", documents=10)
    urls, samples = manifest.urls("train"), [shard.samples for shard in manifest.shards("train")]
    fourth = [sample["__offset__"] for sample in read_shard(urls[0])][3]
    replace_shard(manifest.directory, Path(urls[0]).name, closed_at(Path(urls[0]).read_bytes(), fourth))
    manifest = Manifest.load(manifest.directory)
    assert manifest.problems() == {} and samples == [SHARD_SAMPLES] * 2

    def stream(policy: str) -> Iterator:
        stream = ShardStream(urls, PackedBlocks(ByteTokenizer(), 32), seed=0, samples=samples, policy=policy)
        return stream.examples(0, 1, Cursor())

    short = rf"shard {urls[0]} holds 3 samples, its manifest entry 5: cut short or altered"
    with deadline(30):
        with pytest.raises(ShardError, match=rf"{short}.*set data\.bad_data=skip"):
            list(take(stream("raise"), 200))
        counts = dict.fromkeys(range(len(urls)), (0, 0))  # (read, skipped) of each shard's first epoch
        with pytest.warns(UserWarning, match=short):
            for example in itertools.takewhile(lambda e: e.cursor.shard < len(urls), stream("skip")):
                shard = stream_shard(example.cursor.shard, 0, 1, len(urls), 0)[1]
                counts[shard] = (counts[shard][0] + example.read, counts[shard][1] + example.skipped)
    assert counts == {0: (5, 2), 1: (5, 0)}  # the 2 missing samples counted as read and skipped


# --- runs ----------------------------------------------------------------------------------------------------


def final_data_state(run: Path) -> dict:
    (_, newest), *_ = saved_checkpoints(run / "checkpoints")
    return torch.load(newest, weights_only=True)["ShardDataModule"]


def test_a_run_skips_counts_and_logs_bad_samples(compose_train: ComposeTrain, tmp_path: Path, bad_shards: Path) -> None:
    with pytest.warns(UserWarning, match=r"skipped sample '.*' of .* at byte \d+: "):
        train(compose_train(f"data.dir={bad_shards}", "data.max_skip_fraction=1.0", "trainer.log_every_n_steps=1"))
    state = final_data_state(tmp_path)
    assert state["samples_skipped"] > 0 and state["samples_read"] > state["samples_skipped"]
    with (tmp_path / "csv" / "metrics.csv").open() as file:
        logged = [row for row in csv_rows(file) if row.get("data/skipped_samples")]
    assert float(logged[-1]["data/skipped_samples"]) == state["samples_skipped"]
    assert float(logged[-1]["data/samples_read"]) == state["samples_read"]


def csv_rows(file: io.TextIOBase) -> list[dict[str, str]]:
    import csv

    return list(csv.DictReader(file))


def test_too_many_skipped_samples_stop_the_run_keeping_its_checkpoints(
    compose_train: ComposeTrain, tmp_path: Path, bad_shards: Path
) -> None:
    overrides = [f"data.dir={bad_shards}", "data.max_skip_fraction=0.3", "trainer.max_steps=40"]
    overrides += ["callbacks.checkpoint.every_n_steps=2", "trainer.log_every_n_steps=2"]
    with pytest.warns(UserWarning), pytest.raises(ShardError) as stopped:
        train(compose_train(*overrides))
    assert "training samples were skipped as unusable" in str(stopped.value)
    assert "more than data.max_skip_fraction=0.3" in str(stopped.value) and "The checkpoints saved so far are intact"
    checkpoints = saved_checkpoints(tmp_path / "checkpoints")
    assert checkpoints, "the run stopped before its first checkpoint: the test no longer shows they survive"
    for _, path in checkpoints:
        verify(path)
    assert checkpoints[0][0] < 40


def test_bad_shards_at_start_skip_or_stop(compose_train: ComposeTrain, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    manifest = build_text_shards(data, documents=200)
    missing, altered = (data / shard.name for shard in manifest.shards("train")[:2])
    missing.unlink()
    flipped = bytearray(altered.read_bytes())
    flipped[700] ^= 0xFF
    altered.write_bytes(bytes(flipped))
    before = {path.name: sha256_of(path) for path in data.iterdir()}
    with pytest.raises(ShardError, match=rf"{missing.name}: missing \(listed in the manifest\).*bad_data=skip"):
        train(compose_train(f"data.dir={data}", "data.bad_data=raise"))
    # 2 of about 36 shards: too many for the default 1%, fine for 10%.
    with pytest.warns(UserWarning, match=altered.name), pytest.raises(ShardError, match=r"max_skip_fraction=0\.01"):
        train(compose_train(f"data.dir={data}"))
    with pytest.warns(UserWarning) as caught:
        train(compose_train(f"data.dir={data}", "data.max_skip_fraction=0.1", "trainer.max_steps=6"))
    messages = [str(w.message) for w in caught]
    assert any(f"{altered.name}: altered or corrupt (its sha256 differs" in m and "skipped" in m for m in messages)
    assert {path.name: sha256_of(path) for path in data.iterdir()} == before  # nothing rewritten or removed


def test_fewer_shards_than_sub_streams_warns_and_trains(compose_train: ComposeTrain, tmp_path: Path) -> None:
    data = tmp_path / "shards"
    manifest = build_text_shards(data, documents=20, shard_samples=100)
    assert len(manifest.shards("train")) == 1
    with pytest.warns(UserWarning, match=r"1 training shards of \S+ for 8 sub-streams .* build more, smaller shards"):
        train(compose_train(f"data.dir={data}", "data.streams=4", "data.num_workers=2", "trainer.max_steps=6"))
    assert final_data_state(tmp_path)["steps"] == 6


def test_the_counts_travel_in_the_data_position(bad_shards: Path) -> None:
    data = ShardDataModule(str(bad_shards), ByteTokenizer(), format=packed_blocks(32), global_batch_size=4, streams=2)
    batch = {
        "positions": torch.tensor([[0, 0, 1, 3]]),
        "drawn": torch.tensor([4]),
        "ran_out": torch.tensor([False]),
        "read": torch.tensor(9),
        "skipped": torch.tensor(2),
    }
    assert data.on_before_batch_transfer(dict(batch), 0).keys() == set()  # the objective sees none of it
    data.on_before_batch_transfer(dict(batch, read=torch.tensor(4), skipped=torch.tensor(0)), 0)
    state = data.state_dict()
    assert (state["samples_read"], state["samples_skipped"]) == (13, 2)
    again = ShardDataModule(str(bad_shards), ByteTokenizer(), format=packed_blocks(32), global_batch_size=4, streams=2)
    again.load_state_dict(state)
    assert (again.position.samples_read, again.position.samples_skipped) == (13, 2)
    with pytest.raises(ShardError, match=r"3 of \d+ training samples were skipped"):
        check_skips(3, 10, again.sources, again.max_skip_fraction)
    check_skips(0, 10, again.sources, again.max_skip_fraction)


@pytest.mark.slow  # about 40 s; tests/test_pairs.py shows a stream restarted at any cursor counts its skips exactly
def test_skipping_keeps_the_exact_resume(tmp_path: Path, bad_shards: Path) -> None:
    """Killed and restarted, a run over bad shards trains on the same batches with the same losses and
    weights as an uninterrupted one, and ends with the same counts (skips after the restart included)."""
    overrides = [*tiny_run(), *RESUMABLE, f"data.dir={bad_shards}", "data.max_skip_fraction=1.0"]
    kill_twice_and_compare(tmp_path, overrides, kills=(9,), max_steps=12)
    counts = {}
    for run in ("reference", "killed"):
        checkpoints = dict(saved_checkpoints(run_dir(tmp_path, run) / "checkpoints"))
        states = [torch.load(checkpoints[step], weights_only=True)["ShardDataModule"] for step in (8, 12)]
        counts[run] = [(state["samples_read"], state["samples_skipped"]) for state in states]
    assert counts["killed"] == counts["reference"]
    (read_8, skipped_8), (read_12, skipped_12) = counts["reference"]
    assert 0 < skipped_8 < skipped_12 and read_8 < read_12  # skips before the kill's checkpoint and after it
