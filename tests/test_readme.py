"""The README's commands work as written.

Every line of its bash blocks, and every inline `make ...` or `pretrain ...` command without a
placeholder, is checked here: `pretrain` lines are composed by Hydra and pass the template's config
checks (sweep values: the first of each), `pretrain-*` lines are parsed by their real argument
parsers, `make` lines name existing targets and their `ARGS` compose, scripts exist and parse. A
command no rule covers fails the test, so a new command cannot go unchecked. The Python examples
(your own reader, the z-loss objective, a new kind of example) are run, and `make help` is run as written.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep

from conftest import TINY_RUN
from pretraining import cli
from pretraining.config import CONFIG_DIR, PROJECT_ROOT
from pretraining.data.manifest import Manifest
from pretraining.run import check_config

README = (PROJECT_ROOT / "README.md").read_text()
ENVIRONMENT_ASSIGNMENT = re.compile(r"^[A-Z_]+=")
PLACEHOLDER = re.compile(r"<|\.\.\.|\$|\*")
# Commands of other tools: what each relies on is checked elsewhere, as named.
EXTERNAL = {
    "tar": "a plain tar listing (the shards are plain tar files: tests/test_shards.py)",
    "wandb": "the W&B CLI (the printed sync line: tests/test_tracking.py)",
    "tensorboard": "TensorBoard (the event files: tests/test_tracking.py)",
}


# Console scripts with an argparse command `(argv)`, as pyproject.toml names them. An extra's (under
# pretraining.extras) is checked where this fork keeps the extra.
ENTRY_POINTS = {
    "pretrain-info": "pretraining.cli:info",
    "pretrain-export": "pretraining.extras.hf.cli:main",
    "pretrain-plot": "pretraining.extras.plots.cli:main",
    "pretrain-sweep-report": "pretraining.extras.sweeps.cli:main",
}


def entry_point(program: str) -> Callable[[list[str]], None] | None:
    """The function `program` runs, or None for an extra this fork has deleted."""
    module, _, function = ENTRY_POINTS[program].partition(":")
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), function)


def code_blocks(language: str) -> list[str]:
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", README, re.S) if lang == language]


def readme_commands() -> list[str]:
    """The commands of the bash blocks (continued lines joined, comments dropped) and the inline
    `make`, `pretrain`, `sbatch` and `scripts/` commands without placeholders."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                commands.append(line.strip())
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(r"(make|pretrain|sbatch) \S|scripts/\S+\.sh", span) and not PLACEHOLDER.search(span):
            commands.append(span)
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands()


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (PROJECT_ROOT / "Makefile").read_text(), re.M))


def first_of_each_sweep(overrides: list[str]) -> list[str]:
    """One job of a sweep: the first value of each choice or range, the low end of each interval."""
    job = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_sweep_override():
            job.append(override.input_line)
        elif isinstance(override.value(), IntervalSweep):
            job.append(f"{override.get_key_element()}={override.value().start}")
        else:
            job.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
    return job


def check_composes(overrides: list[str], config_dir: Path) -> None:
    """Hydra composes the overrides (with the README's example model config on the search path) and the
    composed config passes the template's cross-group checks."""
    flags = {"-m", "--multirun", "--help"}
    if "--cfg" in overrides:
        position = overrides.index("--cfg")
        overrides = overrides[:position] + overrides[position + 2 :]
    overrides = first_of_each_sweep([o for o in overrides if o not in flags])
    searchpath = f"hydra.searchpath=[file://{config_dir}]"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, searchpath], return_hydra_config=True)
    check_config(cfg)


def check_make(argv: list[str], config_dir: Path) -> None:
    target, assignments = argv[1], dict(arg.split("=", 1) for arg in argv[2:])
    assert target in makefile_targets(), f"make {target}: no such target"
    args = shlex.split(assignments.get("ARGS", ""))
    experiment = assignments.get("EXPERIMENT", "clm_tiny")
    if target in ("train", "sweep", "sweep-optuna"):
        search = [f"hparams_search={experiment.split('_')[0]}"] if target == "sweep-optuna" else []
        check_composes([f"experiment={experiment}", *search, *args], config_dir)
    elif target == "tokenizer":
        cli.data_parser().parse_args(["tokenizer", "--data", "data/stdlib", *args])
    required = {
        "eval": ["CKPT"],
        "info": ["CKPT"],
        "export": ["CKPT", "OUT"],
        "plot": ["RUN"],
        "sweep-report": ["SWEEP"],
    }
    if assignments:  # not a mere mention of the target
        missing = [name for name in required.get(target, []) if name not in assignments]
        assert not missing, f"make {target} needs {missing[0]}=..."


def check_entry_point(main: Callable[[list[str]], None], args: list[str]) -> None:
    """The arguments parse: the command may fail on the README's paths (absent here), not on its usage."""
    try:
        main(args)
    except SystemExit as error:
        assert error.code != 2, f"usage error for {args}"


def check(command: str, config_dir: Path) -> None:
    argv = shlex.split(command, comments=True)
    while ENVIRONMENT_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    program, args = argv[0], argv[1:]
    if program == "pretrain":
        check_composes(args, config_dir)
    elif program == "make":
        check_make(argv, config_dir)
    elif program == "pretrain-data":
        cli.data_parser().parse_args(args)
    elif program == "pretrain-registry":  # parsed only: run, it would write to this checkout's registry
        if importlib.util.find_spec("pretraining.extras.registry"):
            importlib.import_module("pretraining.extras.registry.cli").registry_parser().parse_args(args)
    elif program in ENTRY_POINTS:
        main = entry_point(program)
        if main is not None:
            check_entry_point(main, args)
    elif program == "sbatch" or program.startswith("scripts/"):
        script, overrides = (args[0], args[1:]) if program == "sbatch" else (program, args)
        subprocess.run(["bash", "-n", str(PROJECT_ROOT / script)], check=True)
        if overrides:  # the scripts pass them to `pretrain`
            check_composes(overrides, config_dir)
    elif program == ".venv/bin/pre-commit":
        assert args in (["install"], ["run", "--all-files"])  # the hooks run in tests/test_devtools.py
        assert (PROJECT_ROOT / ".pre-commit-config.yaml").is_file()
    else:
        assert program in EXTERNAL, f"README command not covered by tests/test_readme.py: {command}"


@pytest.fixture(scope="module")
def example_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's example configs, each named by its first line (`# configs/<group>/<name>.yaml: ...`),
    in a config directory of their own."""
    directory = tmp_path_factory.mktemp("configs")
    for block in code_blocks("yaml"):
        path = re.match(r"# configs/(\S+\.yaml):", block)
        assert path, f"a README config block must start with '# configs/<group>/<name>.yaml: ...': {block[:80]}"
        (directory / path[1]).parent.mkdir(parents=True, exist_ok=True)
        (directory / path[1]).write_text(block)
    return directory


def test_the_readme_has_commands_to_check() -> None:
    assert len(COMMANDS) > 40
    assert "make train" in COMMANDS and any(c.startswith("pretrain -m") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command(
    command: str, example_config_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths of the README do not exist here: nothing real is touched
    check(command, example_config_dir)


def test_a_misspelt_override_in_a_command_would_fail(example_config_dir: Path) -> None:
    with pytest.raises(Exception, match="max_step"):
        check("pretrain experiment=clm_tiny trainer.max_step=2000", example_config_dir)
    with pytest.raises(AssertionError, match="not covered"):
        check("rsync -a logs/ elsewhere/", example_config_dir)


def test_make_help_runs_as_written() -> None:
    result = subprocess.run(["make", "help"], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    listed = set(re.findall(r"^  (\S+)", result.stdout, re.M))
    assert {"train", "test", "sweep", "sweep-optuna", "sweep-report"} <= listed


def test_your_own_reader_example_builds_shards(tmp_path: Path) -> None:
    (example,) = [block for block in code_blocks("python") if "build_papers.py" in block]
    with (tmp_path / "papers.csv").open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["id", "title", "abstract"])
        writer.writerows([i, f"Paper {i}", f"Abstract number {i} about topic {i % 7}."] for i in range(60))
    (tmp_path / "build_papers.py").write_text(example)

    subprocess.run([sys.executable, "build_papers.py"], cwd=tmp_path, check=True, capture_output=True)

    manifest = Manifest.load(tmp_path / "data" / "papers")
    documents = sum(shard.samples for split in ("train", "validation") for shard in manifest.shards(split))
    assert documents == 60 and manifest.shards("validation")


def run_example(
    module: str, overrides: list[str], tmp_path: Path, data: Path, config_dir: Path
) -> subprocess.CompletedProcess:
    """Train a tiny run with the README's example module `module` importable and its configs found."""
    (code,) = [block for block in code_blocks("python") if f"# {module}" in block]
    (tmp_path / module).write_text(code)
    command = [
        sys.executable, "-m", "pretraining", "experiment=clm_tiny", *overrides, *TINY_RUN,
        "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
        f"data.dir={data}", f"paths.log_dir={tmp_path / 'logs'}", "run_name=example",
        f"hydra.searchpath=[file://{config_dir}]",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def logged(tmp_path: Path, metric: str) -> list[float]:
    with (tmp_path / "logs" / "train" / "runs" / "example" / "csv" / "metrics.csv").open() as file:
        return [float(row[metric]) for row in csv.DictReader(file) if row.get(metric)]


def test_the_worked_objective_example_trains(tmp_path: Path, small_shards: Path, example_config_dir: Path) -> None:
    result = run_example("my_objectives.py", ["model=clm_zloss"], tmp_path, small_shards, example_config_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    z_losses = logged(tmp_path, "train/z_loss")
    assert z_losses and all(value > 0 for value in z_losses)


def test_the_new_kind_of_example_trains_and_other_data_is_refused(
    tmp_path: Path, small_shards: Path, example_config_dir: Path
) -> None:
    overrides = ["data=stdlib_documents", "model=document_lm"]
    result = run_example("my_documents.py", overrides, tmp_path, small_shards, example_config_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = logged(tmp_path, "val/loss")
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses) and losses[-1] < losses[0]

    packed = run_example("my_documents.py", ["model=document_lm"], tmp_path, small_shards, example_config_dir)
    assert packed.returncode == 1
    assert "DocumentLM trains on PaddedDocuments examples but the data config makes PackedBlocks" in packed.stderr
