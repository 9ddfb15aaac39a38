"""The model registry: versions keyed by checkpoint digest, aliases with history, taint and rollback, the
ledger under concurrent writers and torn appends, the command line, and the W&B mirror (offline)."""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
import wandb
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from conftest import tiny_run
from pretraining.checkpoint import CheckpointError, save_file, sidecar_path
from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.extras.hf.export import export
from pretraining.extras.registry import mirror as mirror_module
from pretraining.extras.registry.cli import main as registry_command
from pretraining.extras.registry.ledger import LEDGER_FILE
from pretraining.extras.registry.mirror import mirror, waiting
from pretraining.extras.registry.versions import Registry, Version, file_status
from pretraining.train import train


def fake_checkpoint(path: Path, step: int, seed: int = 0, **lineage: object) -> Path:
    """A verified checkpoint file (with its sidecar) of a few bytes, with a lineage and a validation."""
    checkpoint = {
        "global_step": step,
        "state_dict": {"weight": torch.full((2,), float(seed))},
        "lineage": {"format": 4, "step": step, "data_version": "d1", "tokenizer_fingerprint": "t1", **lineage},
    }
    save_file(checkpoint, path)
    record = json.loads(sidecar_path(path).read_text())
    sidecar_path(path).write_text(json.dumps({**record, "validation": {"val/bpb": 3.0 - step / 1000}}))
    return path


@pytest.fixture
def run_checkpoints(tmp_path: Path) -> list[Path]:
    directory = tmp_path / "runs" / "clm" / "checkpoints"
    return [fake_checkpoint(directory / f"step-{step:06d}.ckpt", step, seed=step) for step in (100, 200, 300)]


def test_a_checkpoint_registers_once_by_its_digest_and_resolves_by_alias_number_and_path(
    tmp_path: Path, run_checkpoints: list[Path]
) -> None:
    registry = Registry(tmp_path / "registry")
    first, new = registry.register(run_checkpoints[0])
    assert new and first.name == "v1" and first.run == "clm" and first.step == 100
    assert first.validation == {"val/bpb": 2.9} and first.lineage["data_version"] == "d1"
    second, _ = registry.register(run_checkpoints[1], alias="prod")
    again, new_again = registry.register(run_checkpoints[1])
    assert not new_again and again.number == second.number == 2
    assert second.parents == [1]  # the newest earlier registered checkpoint of its run
    for reference in ("prod", "2", "v2", str(run_checkpoints[1])):
        assert registry.resolve(reference).number == 2
    # A copy elsewhere is the same checkpoint: the digest, not the path, is the key.
    copy = tmp_path / "elsewhere.ckpt"
    shutil.copy(run_checkpoints[1], copy)
    shutil.copy(sidecar_path(run_checkpoints[1]), sidecar_path(copy))
    assert registry.register(copy)[0].number == 2


def test_registering_refuses_a_checkpoint_that_does_not_verify(tmp_path: Path, run_checkpoints: list[Path]) -> None:
    registry = Registry(tmp_path / "registry")
    sidecar_path(run_checkpoints[0]).unlink()
    with pytest.raises(CheckpointError, match="no sidecar"):
        registry.register(run_checkpoints[0])
    with run_checkpoints[1].open("r+b") as file:
        file.seek(-3, 2)
        file.write(b"xyz")
    with pytest.raises(CheckpointError, match="does not match the SHA-256"):
        registry.register(run_checkpoints[1])
    assert registry.state().versions == {}


def test_taint_leaves_the_aliases_and_rollback_returns_to_the_previous_untainted_version(
    tmp_path: Path, run_checkpoints: list[Path]
) -> None:
    registry = Registry(tmp_path / "registry")
    for path in run_checkpoints:
        registry.register(path)
    registry.promote("v1", "prod")
    registry.promote("v2", "prod")
    registry.promote("v3", "prod")
    assert registry.promote("v3", "prod") is None  # already there: nothing written
    registry.promote("v3", "staging")
    tainted = registry.taint("prod", "trained on a leaked test set")
    assert tainted.number == 3 and tainted.taint == "trained on a leaked test set"
    state = registry.state()
    assert state.aliases["prod"] is None and state.aliases["staging"] is None
    with pytest.raises(ConfigError, match="points at no version"):
        registry.resolve("prod")
    with pytest.raises(ConfigError, match="tainted"):
        registry.promote("v3", "prod")
    assert registry.rollback("prod").number == 2
    registry.taint("v1", "bad tokenizer")
    registry.taint("prod", "diverged")  # v2
    with pytest.raises(ConfigError, match="no earlier untainted version"):
        registry.rollback("prod")
    moves = [(event["version"], event["why"]) for event in registry.history("prod")]  # the whole history, kept
    assert moves == [
        (1, "promote"),
        (2, "promote"),
        (3, "promote"),
        (None, "taint of v3"),
        (2, "rollback from no version"),
        (None, "taint of v2"),
    ]


def test_each_rollback_goes_one_version_further_back_and_an_alias_is_never_a_path(
    tmp_path: Path, run_checkpoints: list[Path]
) -> None:
    registry = Registry(tmp_path / "registry")
    for path in run_checkpoints:
        registry.register(path)
    for version in ("v1", "v2", "v3"):
        registry.promote(version, "prod")
    assert registry.rollback("prod").name == "v2"
    assert registry.rollback("prod").name == "v1"
    with pytest.raises(ConfigError, match="no earlier untainted version"):
        registry.rollback("prod")
    registry.promote("v3", "prod")  # a move after rollbacks: rolling back returns to where it came from
    assert registry.rollback("prod").name == "v1"
    for name in ("step-000100.ckpt", "a/b", "latest", "v7", "7up"):
        with pytest.raises(ConfigError, match="an alias starts with a letter"):
            registry.promote("v1", name)
    with pytest.raises(ConfigError, match="tainted already: bad"):
        registry.taint("v1", "bad")
        registry.taint("v1", "worse")


def test_show_says_when_a_registered_file_is_gone_or_changed(tmp_path: Path, run_checkpoints: list[Path]) -> None:
    registry = Registry(tmp_path / "registry")
    for path in run_checkpoints:
        registry.register(path)
    assert file_status(registry.resolve("v1")) == "ok"
    run_checkpoints[0].unlink()
    assert file_status(registry.resolve("v1")).startswith("gone")
    fake_checkpoint(run_checkpoints[1], 200, seed=99)  # another checkpoint saved over it, with its sidecar
    assert file_status(registry.resolve("v2")) == "changed: another checkpoint is at this path now"
    with run_checkpoints[2].open("ab") as file:
        file.write(b"!")
    assert file_status(registry.resolve("v3")).startswith("changed:")
    assert "truncated or altered" in file_status(registry.resolve("v3"))


def register_all(directory: Path, paths: list[Path], alias: str, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()
    registry = Registry(directory)
    for path in paths:
        registry.register(path, alias=alias)


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    """Four processes register 12 checkpoints each at once (one shared by all), moving their own alias each time."""
    shared = fake_checkpoint(tmp_path / "shared" / "step-000001.ckpt", 1, seed=-1)
    per_writer = [
        [shared, *(fake_checkpoint(tmp_path / f"w{w}" / f"step-{s:06d}.ckpt", s, seed=100 * w + s) for s in range(11))]
        for w in range(4)
    ]
    context = multiprocessing.get_context("fork")
    start = context.Barrier(4)
    writers = [
        context.Process(target=register_all, args=(tmp_path / "registry", paths, f"writer{w}", start))
        for w, paths in enumerate(per_writer)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    state = Registry(tmp_path / "registry").state()
    assert sorted(state.versions) == list(range(1, 4 * 11 + 2))  # every checkpoint once, numbers without gaps
    assert len({version.digest for version in state.versions.values()}) == 45
    for w, paths in enumerate(per_writer):
        assert state.versions[state.aliases[f"writer{w}"]].path == str(paths[-1].resolve())
        assert len(state.alias_events[f"writer{w}"]) == 12


def test_a_torn_last_line_is_skipped_and_cut_off_by_the_next_writer(
    tmp_path: Path, run_checkpoints: list[Path]
) -> None:
    registry = Registry(tmp_path / "registry")
    registry.register(run_checkpoints[0])
    ledger = tmp_path / "registry" / LEDGER_FILE
    whole = ledger.read_bytes()
    with ledger.open("ab") as file:
        file.write(b'{"event": "register", "number": 2, "dig')  # a writer killed mid-append
    assert list(registry.state().versions) == [1]
    registry.register(run_checkpoints[1])
    assert ledger.read_bytes().startswith(whole) and ledger.read_bytes().endswith(b"\n")
    assert list(registry.state().versions) == [1, 2]
    ledger.write_bytes(whole + b"not json\n")
    with pytest.raises(ConfigError, match=r"line 2 .* is not JSON"):
        registry.state()


def test_a_second_registration_of_a_version_number_is_refused_as_an_edit(
    tmp_path: Path, run_checkpoints: list[Path]
) -> None:
    """Nothing the registry writes gives a number twice: a line that does is an edit, and would make v1 name
    another file."""
    registry = Registry(tmp_path / "registry")
    registry.register(run_checkpoints[0])
    ledger = tmp_path / "registry" / LEDGER_FILE
    first = json.loads(ledger.read_text())
    other = {**first, "digest": "0" * 64, "path": str(run_checkpoints[1])}
    with ledger.open("a") as file:
        file.write(json.dumps(other) + "\n")
    with pytest.raises(ConfigError, match=r"line 2 of the registry ledger .*v1 is registered already.* edited by hand"):
        registry.state()


def test_the_command_line_prints_each_verb_and_refuses_in_one_line(
    tmp_path: Path, run_checkpoints: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    def command(*args: str) -> str:
        registry_command(["--registry", str(tmp_path / "registry"), *args])
        return capsys.readouterr().out

    changes = [command("register", str(run_checkpoints[0]))]
    assert changes[0].startswith("registered    v1 clm step 100, val/bpb 2.9")
    changes.append(command("register", str(run_checkpoints[1]), "--alias", "prod"))
    assert "[prod]" in changes[-1]
    listed = command("list").splitlines()
    assert listed[0] == "   v1 clm step 100, val/bpb 2.9"
    assert listed[-1].startswith("W&B: 2 version(s) wait to be mirrored; `pretrain-registry mirror` mirrors them")
    changes.append(command("promote", "v1", "prod"))
    assert changes[-1].startswith("prod: v2 -> v1")
    changes.append(command("taint", "v1", "--why", "bad data"))
    assert "removed from prod" in changes[-1]
    changes.append(command("rollback", "prod"))
    assert changes[-1].startswith("prod: no version -> v2")
    assert not [change for change in changes if "W&B" in change]  # offline, a change says nothing of W&B
    shown = json.loads(command("show", "prod", "--json"))
    assert shown["number"] == 2 and shown["file"] == "ok" and "config" not in shown["lineage"]
    assert "TAINTED: bad data" in command("list")
    assert command("history", "prod").count("\n") == 4
    with pytest.raises(SystemExit) as refused:
        command("promote", "v9", "prod")
    assert str(refused.value) == (
        f"pretrain-registry promote: the registry {tmp_path / 'registry'} has no version v9 "
        "(versions v1-v2, aliases: prod)"
    )
    with pytest.raises(SystemExit, match="an alias starts with a letter"):
        command("promote", "v2", "12")


def test_versions_wait_for_the_w_and_b_mirror_offline_and_the_mirror_catches_up(
    tmp_path: Path, run_checkpoints: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    registry = Registry(tmp_path / "registry")
    registry.register(run_checkpoints[0], alias="prod")
    registry.register(run_checkpoints[1])
    assert [version.name for version in waiting(registry.state())] == ["v1", "v2"]
    mirrored, where = mirror(registry, "pretraining-tests", "models")
    assert [version.name for version in mirrored] == ["v1", "v2"] and "offline" in where
    assert waiting(registry.state()) == []
    registry.promote("v2", "prod")  # v1 loses the alias and v2 gains it: W&B has seen neither
    assert [version.name for version in waiting(registry.state())] == ["v1", "v2"]
    offline_runs = list((tmp_path / "registry" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))


def test_the_mirror_records_what_it_sent_and_leaves_a_training_run_alone(
    tmp_path: Path, run_checkpoints: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    registry = Registry(tmp_path / "registry")
    registry.register(run_checkpoints[0])
    training = wandb.init(project="pretraining-tests", dir=tmp_path, mode="offline")
    sent = mirror_module.model_artifact

    def taint_while_sending(version: Version, name: str) -> wandb.Artifact:
        registry.taint(version.name, "found bad while it was sent")  # a colleague, meanwhile
        return sent(version, name)

    monkeypatch.setattr(mirror_module, "model_artifact", taint_while_sending)
    mirror(registry, "pretraining-tests", "models")
    assert [version.name for version in waiting(registry.state())] == ["v1"]  # W&B has not seen the taint
    training.log({"still": 1})  # the training process's run was not finished by the mirror's
    training.finish()
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no credentials
    with pytest.raises(ConfigError, match="no W&B credentials here"):
        mirror(registry, "pretraining-tests", "models")


# Training registers checkpoints; a taint is refused by export and by callbacks.init_from_hf.


def compose_run(root: Path, shard_dir: Path, *overrides: str) -> DictConfig:
    base = [f"paths.output_dir={root}", f"paths.log_dir={root.parent}/logs", f"data.dir={shard_dir}"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=[*base, *tiny_run("clm_tiny"), *overrides])


def test_training_registers_its_best_checkpoints_and_pruning_keeps_them(tmp_path: Path, shard_dir: Path) -> None:
    every_3 = ["trainer.val_check_interval=3", "callbacks.checkpoint.every_n_steps=3", "trainer.max_steps=24"]
    registering = ["callbacks=[default,register]", "callbacks.register.alias=candidate"]
    train(compose_run(tmp_path / "run", shard_dir, *every_3, *registering, "model.optimizer.lr=0.03"))
    with (tmp_path / "run" / "csv" / "metrics.csv").open() as file:  # validations are logged at their step
        validated = [(int(row["step"]), float(row["val/bpb"])) for row in csv.DictReader(file) if row["val/bpb"]]
    best_so_far, best = [], math.inf
    for step, bpb in validated[1:]:  # after the validation before training
        if bpb < best:
            best_so_far, best = [*best_so_far, step], bpb
    registry = Registry(tmp_path / "logs" / "registry")
    versions = list(registry.state().versions.values())
    assert [version.step for version in versions] == best_so_far
    assert 1 < len(versions) < len(validated) - 1  # some beat the ones before, some did not
    assert registry.resolve("candidate").number == versions[-1].number
    saved = {path.name for path in (tmp_path / "run" / "checkpoints").glob("step-*.ckpt")}
    registered = {Path(version.path).name for version in versions}
    assert registered <= saved and all(file_status(version) == "ok" for version in versions)
    assert len(saved - registered) <= 2  # keep_last=2: the rest went, unless registered


def test_the_register_callback_is_refused_before_training_where_it_cannot_work(tmp_path: Path, shard_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"comes after it: callbacks=\[default,register\]"):
        train(compose_run(tmp_path / "run", shard_dir, "callbacks=[register,default]"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    with pytest.raises(ConfigError, match="cannot write to the registry directory"):
        train(
            compose_run(tmp_path / "run", shard_dir, "callbacks=[default,register]", f"paths.registry_dir={unwritable}")
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_tainted_checkpoint_is_not_exported_nor_started_from_unless_forced(tmp_path: Path, shard_dir: Path) -> None:
    train(compose_run(tmp_path / "run", shard_dir, "trainer.max_steps=6"))
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000006.ckpt"
    registry = Registry(tmp_path / "logs" / "registry")
    registry.register(checkpoint)
    registry.taint("v1", "trained on the test split")
    with pytest.raises(
        ConfigError, match=r"registry version v1 .* tainted: trained on the test split.*--allow-tainted"
    ):
        export(checkpoint, tmp_path / "refused", registry_dir=registry.directory)
    assert not (tmp_path / "refused").exists()
    export(checkpoint, tmp_path / "export", registry_dir=registry.directory, allow_tainted=True)
    start = ["trainer.max_steps=2", "callbacks=[default,init_from_hf]"]
    start.append(f"callbacks.init_from_hf.path={tmp_path / 'export'}")
    with pytest.raises(ConfigError, match=r"exported from .*step-000006.ckpt.* tainted.*allow_tainted=true"):
        train(compose_run(tmp_path / "continued", shard_dir, *start))
    assert math.isfinite(train(compose_run(tmp_path / "continued", shard_dir, *start, "allow_tainted=true"))["val/bpb"])
