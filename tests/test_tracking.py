"""What a run shows to its trackers: the offline W&B run (config with lineage, metrics, checkpoint
artifacts) read back from its files, no credentials anywhere, TensorBoard as an option."""

from __future__ import annotations

import csv
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from pretraining.config import REDACTED, redact_secrets
from pretraining.data.manifest import Manifest
from pretraining.loggers import ResumableCSVLogger
from pretraining.train import train

# The offline run file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with
# a 4-byte checksum, a 2-byte length and a 1-byte type (1 whole, 2 first, 3 middle, 4 last).
HEADER_BYTES, BLOCK_BYTES, CHUNK_HEADER_BYTES = 7, 32 * 1024, 7


def wandb_records(run_file: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of an offline `run-<id>.wandb` file, as `wandb sync` would send them."""
    data, offset, pending = run_file.read_bytes(), HEADER_BYTES, b""
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    while offset + CHUNK_HEADER_BYTES <= len(data):
        room = BLOCK_BYTES - offset % BLOCK_BYTES
        if room < CHUNK_HEADER_BYTES:  # a block's tail too short for a chunk header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + CHUNK_HEADER_BYTES])
        if kind == 0:  # zeros: the writer padded the rest of this block
            offset += room
            continue
        if offset + CHUNK_HEADER_BYTES + length > len(data):
            return  # a chunk still being written: the caller reads the file again until it is whole
        chunk = data[offset + CHUNK_HEADER_BYTES : offset + CHUNK_HEADER_BYTES + length]
        offset += CHUNK_HEADER_BYTES + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def finished_run_records(run_file: Path, timeout: float = 60.0) -> list[wandb_internal_pb2.Record]:
    """The records of a finished offline run: W&B's service may still be writing the file's end (up to
    the `exit` record) after `wandb.finish()` has returned."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(wandb_records(run_file))
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def key(item: wandb_internal_pb2.HistoryItem) -> str:
    return item.key or "/".join(item.nested_key)  # "train/loss" may come split into nested keys


def test_redaction_covers_secret_keys_and_environment_credentials() -> None:
    environment = {"HF_TOKEN": "hf_0123456789abcdef", "AWS_SECRET_ACCESS_KEY": "s3cr3t-s3cr3t", "HOME": "/home/me"}
    config = {
        "logger": {"api_key": "plain-text-key", "project": "p"},
        "data": {"url": "https://user:hf_0123456789abcdef@host/x", "dir": "/home/me/data"},
        "callbacks": {"text_sample": {"max_new_tokens": 200}},
        "tokenizer": {"path": "/tmp/tokenizer.json"},
        "notes": ["s3cr3t-s3cr3t"],
    }
    redacted = redact_secrets(config, environment)
    assert redacted["logger"] == {"api_key": REDACTED, "project": "p"}
    assert redacted["data"] == {"url": f"https://user:{REDACTED}@host/x", "dir": "/home/me/data"}  # HOME: no secret
    assert redacted["callbacks"] == config["callbacks"] and redacted["tokenizer"] == config["tokenizer"]
    assert redacted["notes"] == [REDACTED]


def test_offline_wandb_run_holds_config_lineage_metrics_and_artifacts_and_no_secret(
    compose_train, tmp_path: Path, shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "tok-9f8e7d6c5b4a3f2e1d"
    monkeypatch.setenv("MY_SERVICE_TOKEN", secret)
    cfg = compose_train(
        "logger=[wandb,csv,tensorboard]",
        "logger.wandb.checkpoint_artifacts=reference",
        "trainer.log_every_n_steps=2",
        "+paths.service=built-with-${oc.env:MY_SERVICE_TOKEN}",  # a credential interpolated into the config
        "+paths.api_key=typed-in-plain-text",
        "tags=[tracking-test]",
    )
    train(cfg)

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = finished_run_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == (tmp_path / "wandb_run_id").read_text() and list(run.tags) == ["tracking-test"]

    config = {item.key: item.value_json for r in records if r.HasField("config") for item in r.config.update}
    lineage = config["lineage"]
    assert Manifest.load(shard_dir).version in lineage  # the data version: the manifest's hash
    assert '"commit"' in lineage and '"dirty"' in lineage and '"tokenizer_fingerprint"' in lineage

    history = [{key(item): item.value_json for item in r.history.item} for r in records if r.HasField("history")]
    logged = set().union(*history)
    expected = {"train/loss", "val/loss", "val/bpb", "perf/tokens_per_s", "perf/data_wait", "perf/step_time"}
    assert expected <= logged, expected - logged
    assert any(float(row["val/loss"]) > 0 for row in history if "val/loss" in row)

    artifacts = [r.artifact for r in records if r.HasField("artifact")]
    assert [set(a.aliases) for a in artifacts] == [{"latest", "step-6"}, {"latest", "step-12"}]  # saved every 6 steps
    assert all(a.name == f"checkpoints-{run.run_id}" and a.type == "model" for a in artifacts)

    assert any(tmp_path.glob("tensorboard/events.out.tfevents.*"))
    for path in tmp_path.rglob("*"):  # W&B files, CSV hyperparameters, checkpoints, TensorBoard events
        if path.is_file():
            content = path.read_bytes()
            assert secret.encode() not in content and b"typed-in-plain-text" not in content, path


def test_a_new_metric_column_rewrites_the_csv_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logger = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    logger.log_metrics({"train/loss": 2.0}, step=0)
    logger.save()
    metrics_file = tmp_path / "csv" / "metrics.csv"
    before = metrics_file.read_text()

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("pretraining.loggers.os.replace", crash)
    logger.log_metrics({"val/loss": 3.0}, step=1)  # a new column: the file is rewritten with a new header
    with pytest.raises(OSError, match="disk full"):
        logger.save()
    assert metrics_file.read_text() == before  # the crash left the old file whole

    monkeypatch.undo()
    resumed = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")  # the run, restarted
    resumed.log_metrics({"val/loss": 3.0}, step=1)
    resumed.save()
    with metrics_file.open() as file:
        rows = list(csv.DictReader(file))
    assert [(row["step"], row["train/loss"], row["val/loss"]) for row in rows] == [("0", "2.0", ""), ("1", "", "3.0")]
