"""The commands of the README and of every file in docs/ work as written.

Every line of their bash blocks, and every inline `make ...` or `pretrain ...` command without a
placeholder, is checked here: `pretrain` lines are composed by Hydra and pass the template's config
checks (sweep values: the first of each), `pretrain-*` lines are parsed by their real argument
parsers, `make` lines name existing targets (in the Makefile and make/*.mk) and their `ARGS` compose,
scripts exist and parse, and the `rm -r` lines of the README's "What to delete" name paths that exist. A
command no rule covers fails the test, so a new command cannot go unchecked. A command of an extra this
checkout has deleted (README, "What to delete") is left out, so that a fork without it still passes.
The Python examples (a new objective, a new data source, a new backbone, a new kind of example) and the
evaluation of your own task are run, `make help` is run as written, and the links between these files
resolve.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep

from conftest import TINY_RUN
from pretraining.config import CONFIG_DIR, PROJECT_ROOT
from pretraining.data import arguments
from pretraining.data.manifest import Manifest
from pretraining.run import check_config

# The README and the docs, by path relative to the project root.
DOCUMENTS = {
    path.relative_to(PROJECT_ROOT).as_posix(): path.read_text()
    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]
}
ENVIRONMENT_ASSIGNMENT = re.compile(r"^[A-Z_]+=")
PLACEHOLDER = re.compile(r"<|\.\.\.|\$|\*")
# Commands of other tools: what each relies on is checked elsewhere, as named.
EXTERNAL = {
    "tar": "a plain tar listing (the shards are plain tar files: tests/test_shards.py)",
    "wandb": "the W&B CLI (the printed sync line: tests/test_tracking.py)",
    "tensorboard": "TensorBoard (the event files: tests/test_tracking.py)",
    "huggingface-cli": "the hub's download, never run here (its directory: tests/extras/hf/test_continue.py)",
}


# Console scripts with an argparse command `(argv)`, as pyproject.toml names them. An extra's (under
# pretraining.extras) is checked where this fork keeps the extra.
ENTRY_POINTS = {
    "pretrain-info": "pretraining.cli:info",
    "pretrain-export": "pretraining.extras.hf.cli:main",
    "pretrain-plot": "pretraining.extras.plots.cli:main",
    "pretrain-sweep-report": "pretraining.extras.sweeps.cli:main",
    "pretrain-goodput": "pretraining.extras.goodput.cli:main",
    "pretrain-evals": "pretraining.extras.evals.cli:main",
}


# What names an extra in a command (its commands, make targets, config options and keys), and the extras
# it needs besides. The bench extra is scripts/bench; the others are packages under pretraining.extras.
EXTRA_MENTIONS = {
    "registry": r"pretrain-registry|\bmake registry\b|\bregister\b",
    "hf": r"pretrain-export|\bmake export\b|init_from_hf|tokenizer=hf|huggingface-cli",
    "distill": r"distill|model\.teacher",
    "sweeps": r"hparams_search|sweep-optuna|sweep-report|hydra/sweeper=optuna",
    "plots": r"pretrain-plot|\bmake plot\b",
    "probe": r"\bprobe\b",
    "goodput": r"pretrain-goodput|callbacks\.goodput",
    "evals": r"\bevals\b",
    "scaling": r"pretrain-scaling|\bmake ladder\b|EXPERIMENT=ladder|experiment=ladder",
    "bench": r"\bmake bench|scripts/bench/",
}
EXTRA_NEEDS = {"sweeps": {"plots"}}


def extra_kept(extra: str, makefile: bool) -> bool:
    """Whether this checkout keeps `extra` (a fork may delete it): its folder, and with `makefile` (for one
    of its make targets) its make/<extra>.mk."""
    if makefile and not (PROJECT_ROOT / "make" / f"{extra}.mk").is_file():
        return False
    if extra == "bench":
        return (PROJECT_ROOT / "scripts" / "bench").is_dir()
    try:
        return importlib.util.find_spec(f"pretraining.extras.{extra}") is not None
    except ModuleNotFoundError:
        return False


def named_extras(text: str) -> set[str]:
    """The extras `text` names, and those they need."""
    named = {extra for extra, mention in EXTRA_MENTIONS.items() if re.search(mention, text)}
    return named | {needed for extra in named for needed in EXTRA_NEEDS.get(extra, set())}


def deleted_extras(command: str) -> list[str]:
    """The extras `command` names that this checkout does not keep (for an extra's make target: its folder
    and its make file)."""
    argv = command.split()
    targets = named_extras(f"make {argv[1]}") if argv[0] == "make" and len(argv) > 1 else set()
    return sorted(extra for extra in named_extras(command) if not extra_kept(extra, extra in targets))


def entry_point(program: str) -> Callable[[list[str]], None]:
    """The function `program` runs."""
    module, _, function = ENTRY_POINTS[program].partition(":")
    return getattr(importlib.import_module(module), function)


def code_blocks(language: str) -> list[str]:
    """The code blocks of `language` in the README and the docs."""
    return [
        body
        for text in DOCUMENTS.values()
        for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S)
        if lang == language
    ]


def prose(text: str) -> str:
    """`text` without its code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def documented_commands() -> list[str]:
    """The commands of the bash blocks (continued lines joined, comments dropped) and the inline
    `make`, `pretrain`, `sbatch` and `scripts/` commands without placeholders, of every document."""
    commands = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                commands.append(line.strip())
    for text in DOCUMENTS.values():
        for span in re.findall(r"`([^`\n]+)`", prose(text)):
            if re.match(r"(make|pretrain|sbatch) \S|scripts/\S+\.sh", span) and not PLACEHOLDER.search(span):
                commands.append(span)
    return list(dict.fromkeys(commands))


COMMANDS = documented_commands()


def makefile_targets() -> set[str]:
    """The targets of the Makefile and of the extras' make/*.mk it includes."""
    makefiles = [PROJECT_ROOT / "Makefile", *sorted((PROJECT_ROOT / "make").glob("*.mk"))]
    return {target for path in makefiles for target in re.findall(r"^([a-z][a-z-]*):", path.read_text(), re.M)}


def what_to_delete() -> list[list[str]]:
    """The paths of each `rm -r` line of the README's "What to delete" section, one list a line."""
    section = re.search(r"^## What to delete\n(.*?)(?=^## |\Z)", DOCUMENTS["README.md"], re.S | re.M)
    assert section, 'the README has no "## What to delete" section'
    lines = [line for block in re.findall(r"```bash\n(.*?)```", section[1], re.S) for line in block.splitlines()]
    return [shlex.split(line, comments=True)[2:] for line in lines if line.startswith("rm -r ")]


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


def default_experiment() -> str:
    """The Makefile's `EXPERIMENT ?= ...`: what `make train` trains unless told."""
    found = re.search(r"^EXPERIMENT \?= (\S+)$", (PROJECT_ROOT / "Makefile").read_text(), re.M)
    assert found, "the Makefile sets no default EXPERIMENT"
    return found.group(1)


def search_preset(experiment: str) -> str:
    """What `make sweep-optuna` searches (make/sweeps.mk): the experiment's own hparams_search, else its objective's."""
    own = CONFIG_DIR / "hparams_search" / f"{experiment}.yaml"
    return experiment if own.is_file() else experiment.split("_")[0]


def check_make(argv: list[str], config_dir: Path) -> None:
    target, assignments = argv[1], dict(arg.split("=", 1) for arg in argv[2:])
    assert target in makefile_targets(), f"make {target}: no such target"
    args = shlex.split(assignments.get("ARGS", ""))
    experiment = assignments.get("EXPERIMENT", default_experiment())
    if target in ("train", "sweep", "sweep-optuna"):
        search = [f"hparams_search={search_preset(experiment)}"] if target == "sweep-optuna" else []
        check_composes([f"experiment={experiment}", *search, *args], config_dir)
    elif target == "tokenizer":
        arguments.data_parser().parse_args(["tokenizer", "--data", "data/stdlib", *args])
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


def check_deletion(args: list[str]) -> None:
    """An `rm -r` line of "What to delete": one of the README's own, naming paths inside the project that all
    exist, or, in a fork that deleted that extra, none of which does (a path under one another extra's line
    deletes may be gone with that extra)."""
    assert args[:1] == ["-r"] and args[1:] in what_to_delete(), f"rm {' '.join(args)}: not a line of 'What to delete'"
    paths = args[1:]
    for path in paths:
        assert not Path(path).is_absolute() and ".." not in Path(path).parts and not PLACEHOLDER.search(path), path
    kept = (PROJECT_ROOT / paths[0]).exists()
    elsewhere = [Path(other) for line in what_to_delete() if line != paths for other in line]
    for path in paths[1:]:
        gone_with_another = any(Path(path).is_relative_to(other) for other in elsewhere)
        exists = (PROJECT_ROOT / path).exists()
        assert exists == kept or (kept and not exists and gone_with_another), (
            f"rm -r ... {path}: {'missing' if kept else 'still there, though its extra is deleted'}"
        )


def check(command: str, config_dir: Path) -> None:
    missing = deleted_extras(command)
    if missing:
        pytest.skip(f"the {', '.join(missing)} extra is not in this checkout")
    argv = shlex.split(command, comments=True)
    while ENVIRONMENT_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    program, args = argv[0], argv[1:]
    if program == "pretrain":
        check_composes(args, config_dir)
    elif program == "pretrain-eval":  # composed only: run, it would need the checkpoint
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            compose("eval", overrides=args)
    elif program == "make":
        check_make(argv, config_dir)
    elif program == "pretrain-data":
        arguments.data_parser().parse_args(args)
    elif program == "pretrain-registry":  # parsed only: run, it would write to this checkout's registry
        importlib.import_module("pretraining.extras.registry.cli").registry_parser().parse_args(args)
    elif program == "pretrain-scaling":  # parsed only: run, it would train a dozen models
        importlib.import_module("pretraining.extras.scaling.cli").scaling_parser().parse_args(args)
    elif program in ENTRY_POINTS:
        check_entry_point(entry_point(program), args)
    elif program == "rm":
        check_deletion(args)
    elif program == "sbatch" or program.startswith("scripts/"):
        if program == "sbatch":  # its options (--nodes=2) come before the script
            program, *args = itertools.dropwhile(lambda arg: arg.startswith("-"), args)
        script, overrides = program, args
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
    in a config directory of their own (a YAML block named otherwise, a task's say, is its own test's)."""
    directory = tmp_path_factory.mktemp("configs")
    for block in code_blocks("yaml"):
        path = re.match(r"# (configs/)?(\S+\.yaml):", block)
        assert path, f"a README YAML block must start with '# <path>.yaml: ...' (configs/...: a config): {block[:80]}"
        if not path[1]:
            continue
        (directory / path[2]).parent.mkdir(parents=True, exist_ok=True)
        (directory / path[2]).write_text(block)
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
    assert {"train", "test", "test-full", "sweep"} <= listed
    if extra_kept("sweeps", makefile=True):
        assert {"sweep-optuna", "sweep-report"} <= listed


def test_what_to_delete_names_every_extra_once() -> None:
    """Each line deletes one extra: its folder first (a package under pretraining.extras, or scripts/bench)."""
    firsts = [paths[0] for paths in what_to_delete()]
    extras = {f"src/pretraining/extras/{extra}" for extra in EXTRA_MENTIONS if extra != "bench"} | {"scripts/bench"}
    assert sorted(firsts) == sorted(extras)
    for paths in what_to_delete():
        check_deletion(["-r", *paths])


def test_a_backbone_that_is_no_backbone_is_refused(example_config_dir: Path) -> None:
    """README, "A new backbone": the schema refuses a class that is not a Backbone subclass."""
    with pytest.raises(Exception, match="does not make a Backbone"):
        check("pretrain model.backbone._target_=torch.nn.Identity", example_config_dir)


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve() -> None:
    anchors = {
        name: {slug(heading) for heading in re.findall(r"^#+ (.+)$", prose(text), re.M)}
        for name, text in DOCUMENTS.items()
    }
    for name, text in DOCUMENTS.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(text)):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (PROJECT_ROOT / name).parent / path if path else PROJECT_ROOT / name
            assert linked.exists(), f"{name}: a link to {target}, which does not exist"
            key = linked.resolve().relative_to(PROJECT_ROOT).as_posix()
            assert not anchor or anchor in anchors.get(key, set()), f"{name}: a link to {target}, no such heading"


def test_every_doc_says_what_it_covers_and_the_readme_links_it() -> None:
    for name, text in DOCUMENTS.items():
        if name.startswith("docs/"):
            title, blank, statement, after = [*text.splitlines(), "", "", ""][:4]
            assert title.startswith("# ") and not blank and statement and not after, (
                f"{name} starts with its title and a one-line statement of what it covers"
            )
            assert f"({name})" in DOCUMENTS["README.md"], f"the README does not link {name}"


def test_no_inline_code_is_cut_by_a_line_break() -> None:
    """A code span over two lines would hide its command from these checks."""
    for name, text in DOCUMENTS.items():
        for line in prose(text).splitlines():
            assert line.count("`") % 2 == 0, f"{name}: a code span cut at a line break: {line}"


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
    module: str | None, overrides: list[str], tmp_path: Path, data: Path, config_dir: Path
) -> subprocess.CompletedProcess:
    """Train a tiny run in `tmp_path` with the README's example module `module` (if any) importable and its
    configs found."""
    if module is not None:
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


def test_the_backbone_example_trains(tmp_path: Path, small_shards: Path, example_config_dir: Path) -> None:
    result = run_example("my_backbone.py", ["model/backbone=parallel"], tmp_path, small_shards, example_config_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(logged(tmp_path, "val/loss")) == 3
    checkpoint = tmp_path / "logs" / "train" / "runs" / "example" / "checkpoints" / "last.ckpt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert "backbone.blocks.0.attention.q_proj.weight" in state


def test_the_own_task_recipe_scores_the_task(tmp_path: Path, small_shards: Path, example_config_dir: Path) -> None:
    if not extra_kept("evals", makefile=False):
        pytest.skip("the evals extra is not in this checkout")
    (task,) = [block for block in code_blocks("yaml") if block.startswith("# my_tasks/my_task.yaml:")]
    (command,) = [c for c in COMMANDS if "callbacks.evals.include=[my_tasks]" in c]
    (tmp_path / "my_tasks").mkdir()
    (tmp_path / "my_tasks" / "my_task.yaml").write_text(task)
    items = [{"context": f"x = [{i}, {i + 1}", "choices": ["]", ")", "}"], "label": 0} for i in range(12)]
    (tmp_path / "my_tasks" / "my_task.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))

    result = run_example(None, shlex.split(command)[1:], tmp_path, small_shards, example_config_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    for metric in ("acc", "acc_norm"):
        scores = logged(tmp_path, f"eval/my_task/{metric}")
        assert len(scores) == 3 and all(0 <= score <= 1 for score in scores)  # steps 0, 2 and 4


def test_the_open_model_recipe_continues_a_tiny_qwen3_and_exports_it(
    tmp_path: Path, small_shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's commands with its directory replaced by a tiny Qwen3: refused at set-up naming the overrides,
    then continued with them, then exported as a Qwen3."""
    if not extra_kept("hf", makefile=False):
        pytest.skip("the hf extra is not in this checkout")
    from hf.test_continue import stock_model  # the hf extra's tests: a tiny model as the hub has it

    (command,) = [c for c in COMMANDS if c.startswith("pretrain ") and "tokenizer=hf" in c]
    (download,) = [c for c in COMMANDS if c.startswith("huggingface-cli download ")]
    directory = shlex.split(download)[shlex.split(download).index("--local-dir") + 1]
    assert directory in command
    stock_model("qwen3", tmp_path / directory)
    sizes = ("model.backbone.d_model", "model.backbone.n_layer", "model.backbone.n_head")  # the model's, not TINY's
    tiny = [o for o in TINY_RUN[1:] if not o.startswith(sizes)] + ["trainer.max_steps=2"]
    paths = [f"data.dir={small_shards}", f"paths.log_dir={tmp_path / 'logs'}", "run_name=qwen3"]
    run = [sys.executable, "-m", "pretraining", *shlex.split(command)[1:], *tiny, *paths]
    refused = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    (needed,) = re.findall(r": pass (model\.backbone\..*)$", refused.stderr, re.M)
    continued = subprocess.run([*run, *needed.split()], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert continued.returncode == 0, continued.stderr[-3000:]
    checkpoint = tmp_path / "logs" / "train" / "runs" / "qwen3" / "checkpoints" / "last.ckpt"
    monkeypatch.chdir(tmp_path)  # where the run named its tokenizer's directory from
    entry_point("pretrain-export")([str(checkpoint), str(tmp_path / "export")])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


@pytest.mark.slow  # the README's other examples train in the fast suite
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
