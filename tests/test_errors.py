"""Errors a user reads: a config, shard, checkpoint or numerical error of ours prints its message alone at the
command line (HYDRA_FULL_ERROR=1 shows the traceback), names the one constraint it breaks with the real
number of devices; a key mistyped on the command line is refused by Hydra, and with `+` gets the key meant."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import TINY, ComposeTrain
from pretraining.callbacks.numerics import NumericalError
from pretraining.checkpoint import existing_checkpoint, sidecar_path
from pretraining.cli import info as info_main
from pretraining.config import CONFIG_DIR, DIRECTORY_NAME_KEYS, check_directory_names
from pretraining.data.manifest import Manifest
from pretraining.data.reader import ShardReadError, read_shard
from pretraining.data.tokenizer import BPETokenizer
from pretraining.errors import (
    CheckpointError,
    ConfigError,
    MissingFileError,
    PretrainingError,
    ShardError,
)
from pretraining.plugins.checkpoint_io import AtomicCheckpointIO
from pretraining.run import check_config
from pretraining.train import train
from test_bad_data import replace_shard

# (command-line overrides, what the one message says); each run stops before training. The first three need
# two processes (the real number of devices in the message), the next three are refused by Hydra.
BAD_COMMANDS = [
    (
        ["trainer=ddp_cpu", "data.global_batch_size=7"],
        "data.streams=2 does not divide data.global_batch_size=7 (each stream gives a step the same number",
    ),
    (
        ["trainer=ddp_cpu", "data.streams=3", "data.global_batch_size=9"],
        "data.global_batch_size=9 is not divisible by the 2 devices",
    ),
    (
        ["trainer=ddp_cpu", "data.streams=3", "data.global_batch_size=6"],
        "data.streams=3 is not a multiple of the 2 devices",
    ),
    (["data.globl_batch_size=4"], "To append to your config use +data.globl_batch_size=4"),
    (["+data.globl_batch_size=4"], "did you mean data.global_batch_size? Write data.global_batch_size=4 instead"),
    (
        ["+data.block_size=4"],
        "it is a key of the example format, data.format.block_size: write data.format.block_size=4",
    ),
    (["data.dir={tmp}/nonexistent"], "data.dir={tmp}/nonexistent: the directory does not exist: point data.dir at"),
    (["data.dir={tmp}"], "holds no manifest.json, so it holds no shards"),
    (["model.backbone.n_head=3"], "model.backbone.d_model=32 must be divisible by model.backbone.n_head=3"),
    (
        ["callbacks.checkpoint.keep_last=1"],
        "callbacks.checkpoint.keep_last=1 must be at least 2 (a newest checkpoint damaged later",
    ),
    (["callbacks.checkpoint.every_n_steps=0"], "callbacks.checkpoint.every_n_steps=0 must be at least 1: set"),
    (
        ["+data.text_field=json:text"],
        "example format, data.format.text_field: write data.format.text_field='json:text'",
    ),
    (
        ["experiment=contrastive_tiny", "+model.document_masking=true"],
        "model.document_masking is not a parameter of pretraining.objectives.contrastive.Contrastive",
    ),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be at least 1: set"),
    (["trainer.accumulate_grad_batches=2"], "trainer.accumulate_grad_batches=2 is derived from data.micro_batch_size"),
    (["trainer.devices=banana"], "trainer.devices='banana' is not a number of devices, a list of device indices or"),
    (["trainer.accelerator=tpu"], "trainer.accelerator=tpu is not one this template runs on; this machine has "),
    (["model.backbone.vocab_size=10"], "model.backbone.vocab_size=10, but the tokenizer has 260 tokens: leave it out"),
    (["model.backbone.max_seq_len=10000000000"], "model.backbone.max_seq_len=10000000000 must be in [1, 16777216]"),
    (
        ["experiment=clm_modern", "model.backbone.max_seq_len=10000000000"],
        "model.backbone.max_seq_len=10000000000 must be in [1, 16777216]",
    ),
    (["model.backbone.max_seq_len=1e10"], "model.backbone.max_seq_len=10000000000.0 is not an integer"),
    (["model.optimizer.lr=nan"], "model.optimizer.lr=nan must be a finite number > 0"),
    (["experiment=clm_modern", "model.optimizer.muon_lr=nan"], "model.optimizer.muon_lr=nan must be a finite number"),
    (["model.min_lr_ratio=nan"], "model.min_lr_ratio=nan must be a finite number in [0, 1]"),
    (["experiment=clm_modern", "model.backbone.norm_eps=nan"], "model.backbone.norm_eps=nan must be a finite number"),
]
TWO_PROCESSES, REFUSED_BY_HYDRA, IN_ONE_PROCESS = BAD_COMMANDS[:3], BAD_COMMANDS[3:6], BAD_COMMANDS[6:]


def start(program: str, overrides: list[str], cwd: Path, **env: str) -> subprocess.Popen[str]:
    command = [str(Path(sys.executable).parent / program), *overrides]  # the console script
    environment = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"} | env
    return subprocess.Popen(
        command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


def assert_each_prints_its_message_alone(
    commands: list[tuple[list[str], str]], tmp_path: Path, shard_dir: Path
) -> None:
    """`pretrain` with each command's overrides (all at once) exits 1 printing its message, no traceback."""
    base = [*TINY, "data.streams=2", f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}/logs"]
    runs = []
    for overrides, message in commands:
        filled = [override.format(tmp=tmp_path) for override in overrides]
        runs.append((filled, message.format(tmp=tmp_path), start("pretrain", [*base, *filled], tmp_path)))
    for overrides, message, process in runs:
        returncode, stderr = finish(process)
        assert returncode == 1, (overrides, stderr)
        assert message in stderr, (overrides, stderr)
        assert "Traceback" not in stderr and "1 devices" not in stderr, (overrides, stderr)
        said = next(line for line in stderr.splitlines() if message in line)
        if overrides == ["callbacks.checkpoint.keep_last=1"]:  # the one constraint it breaks
            assert "every_n_steps" not in said and "keep_every" not in said, said


def test_bad_commands_print_one_message_without_a_traceback(tmp_path: Path, shard_dir: Path) -> None:
    """A bad command of each kind under the real entry points; HYDRA_FULL_ERROR=1 shows the traceback."""
    assert_each_prints_its_message_alone([TWO_PROCESSES[0], REFUSED_BY_HYDRA[1]], tmp_path, shard_dir)
    for program, overrides, message, env in [
        ("pretrain-eval", ["+max_new_token=3"], "did you mean max_new_tokens?", {}),
        ("pretrain", ["callbacks.checkpoint.keep_last=1"], "keep_last=1 must be at least 2", {"HYDRA_FULL_ERROR": "1"}),
    ]:
        returncode, stderr = finish(start(program, [*overrides, f"paths.log_dir={tmp_path}"], tmp_path, **env))
        assert returncode == 1 and message in stderr, stderr
        assert ("Traceback" in stderr) == bool(env), stderr


# A run, and (in the slow suite: the same callback) a multirun; each command takes ~9 s to load its callbacks.
@pytest.mark.parametrize(
    ("key", "overrides"),
    [
        ("run_name", ["run_name=${hydra:job.name}/../../../../escape"]),  # resolved as the job would
        pytest.param("task_name", ["-m", "task_name=../escape", "seed=1,2"], marks=pytest.mark.slow),
        pytest.param(
            "hydra.sweep.subdir", ["-m", "hydra.sweep.subdir=../../../escape", "seed=1,2"], marks=pytest.mark.slow
        ),
    ],
)
def test_a_name_that_is_not_one_directorys_is_refused_before_any_directory_is_made(
    tmp_path: Path, key: str, overrides: list[str]
) -> None:
    returncode, stderr = finish(start("pretrain", [*overrides, f"paths.log_dir={tmp_path}/a/b/logs"], tmp_path))
    assert returncode == 1 and stderr.splitlines() == [stderr.strip()], stderr
    assert stderr.startswith(f"{key}='") and "../escape" in stderr and f"pass {key}=<name>" in stderr, stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../../escape"])
def test_task_and_run_names_are_one_directorys(name: str) -> None:
    check_directory_names(OmegaConf.create({"task_name": "train", "run_name": "clm_tiny-0a1b2c3d"}))
    for key in DIRECTORY_NAME_KEYS:
        config = OmegaConf.create({"task_name": "train", "run_name": "clm_tiny", key: name})
        with pytest.raises(ConfigError, match=f"^{key}="):
            check_directory_names(config)


def test_a_name_longer_than_the_file_system_allows_is_refused_naming_the_key(tmp_path: Path) -> None:
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    names = {"task_name": "train", "run_name": "clm_tiny", "paths": {"log_dir": str(tmp_path / "not" / "yet")}}
    check_directory_names(OmegaConf.create({**names, "run_name": "r" * longest}))
    room = {"task_name": longest - len(".log"), "run_name": longest}  # <task_name>.log is the run's log file
    check_directory_names(OmegaConf.create({**names, "task_name": "t" * room["task_name"]}))
    for key in DIRECTORY_NAME_KEYS:
        with pytest.raises(
            ConfigError,
            match=rf"^{key}='xxx.*' is {room[key] + 1} bytes long, and may be {room[key]} bytes at "
            rf"most on this file system: pass a shorter {key}=<name>$",
        ):
            check_directory_names(OmegaConf.create({**names, key: "x" * (room[key] + 1)}))


@pytest.mark.slow  # ~10 s: the directory-names callback under the entry point (the fast test above: its rule)
def test_a_run_name_too_long_for_the_file_system_is_refused_in_one_line(tmp_path: Path) -> None:
    returncode, stderr = finish(
        start("pretrain", ["run_name=" + "a" * 300, f"paths.log_dir={tmp_path}/logs"], tmp_path)
    )
    assert returncode == 1 and stderr.splitlines() == [stderr.strip()], stderr
    assert stderr.startswith("run_name='aaa") and "pass a shorter run_name=<name>" in stderr, stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow  # every bad command under the entry point: the fast suite has one of each kind, and the rest below
def test_every_bad_command_prints_one_message_without_a_traceback(tmp_path: Path, shard_dir: Path) -> None:
    assert_each_prints_its_message_alone(BAD_COMMANDS, tmp_path, shard_dir)


@pytest.mark.parametrize(("overrides", "message"), IN_ONE_PROCESS, ids=[" ".join(o) for o, _ in IN_ONE_PROCESS])
def test_a_bad_config_stops_before_any_work_naming_the_one_constraint(
    compose_train: ComposeTrain, tmp_path: Path, overrides: list[str], message: str
) -> None:
    experiment = next((o.split("=")[1] for o in overrides if o.startswith("experiment=")), "clm_tiny")
    filled = [o.format(tmp=tmp_path) for o in overrides if not o.startswith("experiment=")]
    with pytest.raises(PretrainingError, match=re.escape(message.format(tmp=tmp_path))):
        train(compose_train(*filled, experiment=experiment))
    assert not (tmp_path / "checkpoints").exists()


def test_our_errors_are_hydras_compact_ones_and_keep_their_builtin_bases() -> None:
    for error in (ConfigError, MissingFileError, CheckpointError, ShardError, NumericalError):
        assert issubclass(error, PretrainingError), error
    assert issubclass(ConfigError, ValueError) and issubclass(ShardError, ValueError)
    assert issubclass(MissingFileError, FileNotFoundError) and issubclass(CheckpointError, RuntimeError)
    assert issubclass(NumericalError, RuntimeError)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.globl_batch_size=4",
            r"not a parameter of pretraining\.data\.datamodule\.ShardDataModule: "
            r"did you mean data\.global_batch_size\?",
        ),
        ("data.format.blok_size=8", r"did you mean data\.format\.block_size\? Write data\.format\.block_size=8"),
        ("data.query_len=8", r"it is a key of the example format, data\.format\.query_len"),
        ("trainer.max_step=3", r"did you mean trainer\.max_steps\?"),
        ("sed=3", r"sed=3: sed is not a key of configs/train.yaml: did you mean seed\?"),
    ],
)
def test_a_mistyped_key_is_refused_by_hydra_and_added_with_plus_names_the_key_meant(
    override: str, message: str, compose_train: ComposeTrain
) -> None:
    experiment = "contrastive_tiny" if "query_len" in override else "clm_tiny"
    with (
        initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"),
        pytest.raises(ConfigCompositionException, match=r"To append to your config use \+"),
    ):
        compose("train", overrides=[f"experiment={experiment}", override])
    with pytest.raises(ConfigError, match=message):
        check_config(compose_train(f"+{override}", experiment=experiment))


NO_FILES = [("fifo.ckpt", "a named pipe"), ("/dev/zero", "a device")]  # under tmp_path, or where they are


def no_files(tmp_path: Path) -> list[tuple[Path, str]]:
    """A named pipe would block a command reading it forever, a device never end."""
    os.mkfifo(tmp_path / "fifo.ckpt")
    return [(tmp_path / name, said) for name, said in NO_FILES]


def test_a_checkpoint_that_is_no_file_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    for path, said in no_files(tmp_path):
        with pytest.raises(MissingFileError, match=rf"checkpoint {path} is {said}"):
            existing_checkpoint(path)  # every command reads a checkpoint through it
    with pytest.raises(SystemExit, match=r"^pretrain-info: checkpoint /dev/zero is a device"):
        info_main(["/dev/zero"])


def test_pretrain_info_fails_on_a_checkpoint_that_does_not_verify_after_printing_what_it_can(
    tmp_path: Path, capsys
) -> None:
    path = tmp_path / "step-000001.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "state_dict": {}, "lineage": {"step": 1}}, path)
    info_main([str(path)])  # verifies: exits normally
    sidecar_path(path).write_text("{not json")
    with pytest.raises(SystemExit, match=rf"^pretrain-info: sidecar {path}\.json is unreadable"):
        info_main([str(path)])
    assert re.search(r"verified\s+sidecar \S+ is unreadable", capsys.readouterr().out)


@pytest.mark.slow  # four console commands, each loading torch; the fast suite has the check they rely on, above
def test_the_commands_refuse_a_checkpoint_that_is_no_file_at_once_in_one_line(tmp_path: Path) -> None:
    """Each command that reads a checkpoint stops at once on a named pipe or a device (a hang fails on the
    timeout), printing one line."""
    cases = no_files(tmp_path)
    runs = [(path, said, start("pretrain-info", [str(path)], tmp_path)) for path, said in cases] + [
        (path, said, start("pretrain-eval", [f"ckpt_path={path}", f"paths.log_dir={tmp_path}"], tmp_path))
        for path, said in cases
    ]
    for path, said, process in runs:
        try:
            _, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 1 and f"checkpoint {path} is {said}, not a file" in stderr, stderr
        assert "Traceback" not in stderr, stderr


def test_a_manifest_or_tokenizer_that_is_no_file_is_named_so(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(MissingFileError, match=r"manifest \S+manifest.json is a named pipe, not a file"):
        Manifest.load(tmp_path)
    with pytest.raises(MissingFileError, match=r"tokenizer file \S+ is a directory, not a file"):
        BPETokenizer(tmp_path)


def test_a_shard_directory_that_is_missing_or_not_built_says_which(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"data\.dir=\S+/gone: the directory does not exist"):
        Manifest.load(tmp_path / "gone", key="data.dir")
    with pytest.raises(ShardError, match=r"holds no manifest\.json.*pretrain-data build --out"):
        Manifest.load(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ShardError, match="is a file, not a directory"):
        Manifest.load(tmp_path / "file")


def damaged(shard: bytes, how: str) -> bytes:
    """`shard` damaged at its third member's header (if it has one), where Python's tarfile would end the
    archive silently."""
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        members = tar.getmembers()
    if len(members) < 3:
        return shard
    at = members[2].offset
    if how == "cut":
        return shard[:at]
    fill = b"\x07" if how == "garbage" else b"\0"
    return shard[:at] + fill * 1024 + shard[at + 1024 :]


@pytest.mark.parametrize("how", ["cut", "garbage", "zeroed"])
def test_a_shard_damaged_at_a_header_is_not_ended_silently(tmp_path: Path, shard_dir: Path, how: str) -> None:
    url = Manifest.load(shard_dir).urls("train")[0]
    path = tmp_path / "shard.tar"
    path.write_bytes(damaged(Path(url).read_bytes(), how))
    seen: list[dict[str, object]] = []
    with pytest.raises(ShardReadError, match=rf"{path} cannot be read past byte \d+"):
        seen.extend(read_shard(str(path)))
    assert len(seen) == 1  # the first sample (two members: txt and json), whole
    assert len(list(read_shard(url))) > 1  # an intact shard ends at its zero blocks


def damaged_copy(shards: Path, data: Path, how: str) -> Path:
    """A copy of `shards` whose training shards have a tar header damaged `how` mid-shard."""
    data.mkdir()
    for path in shards.iterdir():
        (data / path.name).write_bytes(path.read_bytes())
    for url in Manifest.load(data).urls("train"):
        replace_shard(data, Path(url).name, damaged(Path(url).read_bytes(), how))
    return data


@pytest.mark.slow
def test_bad_data_raise_on_a_damaged_shard_exits_non_zero(tmp_path: Path, shard_dir: Path) -> None:
    """A shard damaged after its manifest was written (checksums not verified at start): the run stops
    on it with one message, whether the DataLoader reads in the main process or in a worker."""
    data = damaged_copy(shard_dir, tmp_path / "data", "zeroed")
    base = [*TINY, f"data.dir={data}", "data.bad_data=raise", "validate_before_training=false"]
    runs = [
        start("pretrain", [*base, f"data.num_workers={n}", f"paths.log_dir={tmp_path}/{n}"], tmp_path) for n in (0, 1)
    ]
    for run in runs:
        returncode, stderr = finish(run)
        assert returncode == 1, stderr
        assert "bad data: " in stderr and "data.bad_data=raise stops on it" in stderr, stderr
        assert "Traceback" not in stderr, stderr


def test_bad_data_raise_stops_the_run_on_a_damaged_shard(
    compose_train: ComposeTrain, tmp_path: Path, shard_dir: Path
) -> None:
    data = damaged_copy(shard_dir, tmp_path / "data", "garbage")
    with pytest.raises(ShardError, match=r"the tar header at byte \d+ is damaged.*data\.bad_data=raise stops on it"):
        train(compose_train(f"data.dir={data}", "data.bad_data=raise", "validate_before_training=false"))
