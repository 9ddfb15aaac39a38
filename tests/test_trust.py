"""Nothing read from a checkpoint runs code: a stored config builds only trusted classes, and a
pickled payload is refused by every route that loads a checkpoint; the payloads provably never ran. A file a
run appends to is written where it is: never through a planted link, nor blocking on a pipe."""

from __future__ import annotations

import builtins
import copy
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pretraining.checkpoint import load_weights_only, save_file
from pretraining.checkpoint.sharded import load_shards
from pretraining.cli import data as pretrain_data
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR
from pretraining.data.manifest import SPLITS
from pretraining.errors import CheckpointError, ConfigError, ShardError
from pretraining.evaluate import evaluate
from pretraining.files import RunLogFile
from pretraining.train import train


def evaluate_checkpoint(path: Path, out: Path, *overrides: str) -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=[f"ckpt_path={path}", f"paths.output_dir={out}", "prompt=null", *overrides])
    return evaluate(cfg)


def opens(marker: Path, target: str = "builtins.open") -> dict[str, Any]:
    """A config node that, built, creates `marker`."""
    return {"_target_": target, "_args_": [str(marker), "w"]}


class Payload:
    """A pickled object that, unpickled without the weights-only guard, creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (str(self.marker), "w"))


def crafted_configs(marker: Path) -> dict[str, Any]:
    """Edits of a stored config, each one building something outside the package, by key."""

    def edit(path: str, node: Any) -> Any:
        def apply(config: dict[str, Any]) -> None:
            *parents, last = path.split(".")
            for key in parents:
                config = config[key]
            config[last] = node

        return apply

    return {
        "tokenizer._target_": edit("tokenizer", opens(marker)),
        r"model.backbone.extra\[1\]._target_": edit("model.backbone.extra", [1, opens(marker)]),
        "data.format.extra._target_": edit("data.format.extra", opens(marker)),
        "model.optimizer._target_": edit("model.optimizer", {**opens(marker, "os.system"), "_partial_": True}),
        # starts like a class of ours, but is an attribute chain to a function of the standard library
        "model.backbone._target_": edit("model.backbone", opens(marker, "pretraining.evaluate.json.dump")),
        "data._target_": edit("data", opens(marker, "pretraining_evil.Module")),
        # a node outside the groups checked, brought in by an interpolation
        "tokenizer.unused": edit("tokenizer.unused", "${pwn}"),
    }


def test_a_stored_config_builds_only_trusted_classes(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    trained = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    marker = tmp_path / "marker"
    for key, edit in crafted_configs(marker).items():
        checkpoint = copy.deepcopy(trained)
        checkpoint["lineage"]["config"]["pwn"] = opens(marker, "pathlib.Path.touch")
        edit(checkpoint["lineage"]["config"])
        path = tmp_path / "crafted" / "step-000006.ckpt"
        save_file(checkpoint, path)  # with a sidecar that vouches for it
        with pytest.raises(ConfigError, match=rf"{key}=.* in the config stored in {path} (is|names)"):
            evaluate_checkpoint(path, tmp_path)
        assert not marker.exists(), key


def test_a_stored_config_that_cannot_be_rebuilt_is_refused_in_one_line_naming_the_file(
    compose_train, tmp_path: Path
) -> None:
    """A key holding an interpolation is refused as a value holding one is; a key no class takes (an edit, or
    another code revision) stops the rebuild with one line, not Hydra's error."""
    train(compose_train("trainer.max_steps=6"))
    trained = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    path = tmp_path / "crafted" / "step-000006.ckpt"
    stored = f"the config stored in {re.escape(str(path))}"
    for group, key, refusal in [
        ("model", "${oc.env:HOME}", rf"the key model\.\$\{{oc\.env:HOME\}} in {stored} is an interpolation"),
        ("model", "unknown_setting", rf"{stored} cannot be rebuilt \(.*unknown_setting"),
        ("data", "unknown_setting", rf"{stored} cannot be rebuilt \(.*unknown_setting"),
    ]:
        checkpoint = copy.deepcopy(trained)
        checkpoint["lineage"]["config"][group][key] = 1
        save_file(checkpoint, path)
        with pytest.raises(ConfigError, match=refusal) as refused:
            evaluate_checkpoint(path, tmp_path)
        assert "\n" not in str(refused.value)


def test_trusted_targets_let_your_own_classes_through(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6", "model._target_=test_train.CausalLMWithZLoss", "+model.z_loss=0.01"))
    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(
        ConfigError, match=r"model._target_='test_train.CausalLMWithZLoss' .* pass trusted_targets=\[test_train\]$"
    ):
        evaluate_checkpoint(path, tmp_path)
    assert "val/loss" in evaluate_checkpoint(path, tmp_path, "trusted_targets=[test_train]")


def test_a_pickled_payload_is_refused_by_every_route(compose_train, tmp_path: Path) -> None:
    train(compose_train("trainer.max_steps=6"))
    marker = tmp_path / "marker"
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["loops"]["payload"] = Payload(marker)
    path = tmp_path / "checkpoints" / "step-000006.ckpt"
    save_file(checkpoint, path)  # the run's own checkpoint, replaced, with a sidecar that vouches for it
    refusal = rf"{path} holds objects other than tensors and plain data \(it refers to io.open\).* will not be loaded"
    with pytest.raises(CheckpointError, match=refusal):
        evaluate_checkpoint(path, tmp_path)
    with pytest.raises(SystemExit, match=refusal):
        info_main([str(path)])
    with pytest.raises(CheckpointError, match=refusal):  # resuming the run (Lightning's loader)
        train(compose_train("trainer.max_steps=12"))
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors") as refused:
        train(compose_train("trainer.max_steps=12", f"ckpt_path={path}", "run_name=another"))
    assert "weights_only=False" not in str(refused.value)
    assert not marker.exists()


def test_the_objects_beside_a_sharded_checkpoints_tensors_load_weights_only(tmp_path: Path) -> None:
    """DCP unpickles what it saved beside the tensors (an optimizer's param groups) with
    `weights_only=False`; the loaders here refuse anything but plain data there too."""
    marker, directory = tmp_path / "marker", tmp_path / "sharded"

    def load(saved: Any) -> dict[str, Any]:
        shutil.rmtree(directory, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.distributed is not initialised: one process is the intent
            dcp.save({"optimizer_0": {"param_groups": [saved]}}, checkpoint_id=directory, no_dist=True)
            state = {"optimizer_0": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
            load_shards(state, directory, no_dist=True)
        return state

    plain = {"lr": 0.1, "betas": (0.9, 0.95)}
    assert load(plain)["optimizer_0"]["param_groups"] == [plain]
    with pytest.raises(CheckpointError, match=rf"{directory} holds objects other than tensors and plain data"):
        load({"lr": Payload(marker), "betas": (0.9, 0.95)})
    assert not marker.exists()


def test_a_file_that_is_no_checkpoint_is_called_damaged_not_dangerous(tmp_path: Path) -> None:
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(b"\x80\x02garbage" * 10)
    with pytest.raises(CheckpointError, match="cannot be read as a checkpoint: it is damaged") as refused:
        load_weights_only(path)
    assert "weights_only" not in str(refused.value)


def test_a_stored_config_cannot_allow_the_commands_of_a_manifest(
    compose_train, tmp_path: Path, shard_dir: Path
) -> None:
    """`pretrain-eval` runs a manifest's `pipe:` commands on its own command line's word, never on the
    checkpoint's stored `data.trust_pipe_commands`."""
    train(compose_train("trainer.max_steps=6"))
    marker = tmp_path / "marker"
    commands = tmp_path / "commands"
    train_shard, validation_shard = (f"pipe:touch {marker}; cat {shard_dir}/{split}-000000.tar" for split in SPLITS)
    pretrain_data(["index", train_shard, "--validation", validation_shard, "--out", str(commands), "--quiet"])
    marker.unlink()
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["lineage"]["config"]["data"] |= {"dir": str(commands), "trust_pipe_commands": True}
    path = tmp_path / "crafted" / "step-000006.ckpt"
    save_file(checkpoint, path)
    with pytest.raises(ShardError, match=r"running shell commands .* allow them with trust_pipe_commands=true$"):
        evaluate_checkpoint(path, tmp_path)
    assert not marker.exists()
    assert "val/loss" in evaluate_checkpoint(path, tmp_path, "trust_pipe_commands=true") and marker.exists()


def test_the_run_log_is_not_written_through_a_link_nor_blocks_on_a_pipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside.log"
    outside.write_text("kept\n")
    (tmp_path / "link.log").symlink_to(outside)
    os.mkfifo(tmp_path / "pipe.log")
    (tmp_path / "dir.log").mkdir()
    record = logging.LogRecord("pretraining", logging.INFO, __file__, 1, "a line", None, None)
    for name in ("link.log", "pipe.log", "dir.log"):
        handler = RunLogFile(str(tmp_path / name), delay=False)
        handler.emit(record)
        handler.close()
        assert f"warning: the run's log file {tmp_path / name} is a" in capsys.readouterr().err
    assert outside.read_text() == "kept\n"
    handler = RunLogFile(str(tmp_path / "late.log"), delay=True)
    (tmp_path / "late.log").symlink_to(outside)  # put there after the handler was made, before its first line
    handler.emit(record)
    handler.close()
    assert outside.read_text() == "kept\n" and "late.log is a symbolic link" in capsys.readouterr().err
    handler = RunLogFile(str(tmp_path / f"{'x' * 300}.log"))  # a name the file system does not take
    handler.emit(record)
    assert "File name too long" in capsys.readouterr().err
    handler = RunLogFile(str(tmp_path / "train.log"), delay=True)
    handler.emit(record)
    handler.close()
    assert (tmp_path / "train.log").read_text() == "a line\n"
    # Hydra makes the run's log file so (a real run with a link there: tests/extras/goodput/test_damaged_record.py).
    handlers = OmegaConf.load(CONFIG_DIR / "hydra" / "default.yaml").job_logging.handlers
    assert handlers.file["class"] == "pretraining.files.RunLogFile"
