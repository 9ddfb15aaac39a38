"""The package's import floors follow the data path (README, "The map"): a module imports only from its
own floor and the floors below, never upward, without cycles, and from inside a function only where
`DEFERS_IMPORTS` says why (the console commands, and what a run loads only when it uses it). The core never
imports an extra (`pretraining.extras`); an extra imports the core and other extras, each on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_run
from pretraining.config import PROJECT_ROOT
from pretraining.instantiate import within

PACKAGE = PROJECT_ROOT / "src" / "pretraining"
# Lowest first. A module is on the floor of the longest prefix of its name listed here.
FLOORS = [
    (
        "ground",
        [
            "errors",
            "ranges",
            "files",
            "distributed",
            "instantiate",
            "checkpoint",
            "run_lock",
            "quiet",
            "compat",
            "slurm",
        ],
    ),
    ("data", ["data"]),
    ("models", ["models"]),
    ("internals", ["internals"]),
    ("plugins", ["plugins"]),
    ("objectives", ["objectives"]),
    ("callbacks", ["callbacks", "loggers"]),
    (
        "run set-up",
        ["config", "schema", "settings", "resume", "stored", "init_from", "run", "report", "launch", "job_status"],
    ),
    ("entry points", ["train", "evaluate", "info", "data.commands"]),
    ("commands", ["cli", "__main__"]),
    ("extras", ["extras"]),
]
# The modules whose imports of the package may wait inside a function: the core's and each extra's
# commands, for a fast `--help`; what Lightning or Hydra load for every run but use in some only, so that a
# run loads only what it uses (the FSDP2 strategy's sharded format, a multirun's report); the readers of older
# versions' formats, which only an old checkpoint or a refused key loads (`pretraining.compat`).
DEFERS_IMPORTS = (
    "cli",
    "extras.hf.cli",
    "extras.plots.cli",
    "extras.registry.cli",
    "extras.sweeps.cli",
    "extras.goodput.cli",
    "extras.evals.cli",
    "extras.scaling.cli",
    "plugins",
    "plugins.fsdp",
    "objectives.base",
    "extras.sweeps.callback",
    "data.position",
    "schema",
    "data.manifest",  # the hashing reader (data.digest), which only a start-up check of remote shards uses
)
# The floors without Lightning, and the names it is imported under.
NO_LIGHTNING = ("ground", "models")
LIGHTNING = {"lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"pretraining.{module} is on no floor: add it to FLOORS (and to the README's map)"
    return max(matches)[1]


def imports(path: Path) -> list[tuple[str, bool]]:
    """The absolute names `path` imports, and whether each import is inside a function."""
    tree = ast.parse(path.read_text())
    inside = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in inside) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in inside))
    return found


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if module_name(path)}


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_its_own_floor_and_those_below(module: str) -> None:
    floor = floor_of(module)
    for name, in_function in imports(MODULES[module]):
        top = name.split(".")[0]
        if top == "pretraining":
            imported = name.removeprefix("pretraining").lstrip(".")
            assert not in_function or module in DEFERS_IMPORTS, f"pretraining.{module} imports {name} inside a function"
            assert floor_of(imported) <= floor, (
                f"pretraining.{module} ({FLOORS[floor][0]}) imports {name} ({FLOORS[floor_of(imported)][0]}), "
                "a floor above it"
            )
        elif FLOORS[floor][0] in NO_LIGHTNING:
            assert top not in LIGHTNING, f"pretraining.{module} ({FLOORS[floor][0]}) imports {name}"


def test_the_core_imports_no_extra() -> None:
    """A fork deletes an extra's folder and nothing else breaks (README, "What to delete")."""
    for module, path in MODULES.items():
        if not module.startswith("extras"):
            for name, _ in imports(path):
                assert not name.startswith("pretraining.extras"), f"pretraining.{module} (the core) imports {name}"


@pytest.mark.parametrize("module", [module for module in MODULES if module.startswith("models.")])
def test_a_backbone_imports_only_torch_the_checks_of_its_settings_and_other_models(module: str) -> None:
    checks = {"pretraining.ranges", "pretraining.errors"}
    standard = {"__future__", "abc", "collections", "dataclasses", "functools", "math", "os", "typing", "torch"}
    for name, _ in imports(MODULES[module]):
        assert name.split(".")[0] in standard or name in checks or name.startswith("pretraining.models."), name


def test_no_import_cycles() -> None:
    graph = {
        module: {
            target
            for name, _ in imports(path)
            if name.startswith("pretraining.")
            for target in [name.removeprefix("pretraining.")]
            if target in MODULES
        }
        for module, path in MODULES.items()
    }
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join([*path, module, target])
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


# What a next-token run on one process leaves unloaded: what a run loads is what a fork must read.
NOT_LOADED_BY_A_PLAIN_RUN = [
    "pretraining.plugins.fsdp",  # an FSDP2 run's
    "pretraining.models.llama",  # the backbone it does not build
    "pretraining.data.pair_format",  # a contrastive run's
    "pretraining.data.arguments",  # pretrain-data's
    "pretraining.compat",  # an old checkpoint's
    "pretraining.extras.goodput",  # opt-in
]


def test_a_plain_run_loads_only_what_it_uses(tmp_path: Path, shard_dir: Path) -> None:
    overrides = [*tiny_run(), f"data.dir={shard_dir}", f"paths.output_dir={tmp_path}", "trainer.max_steps=2"]
    script = f"""
import sys
from hydra import compose, initialize_config_dir
from pretraining.config import CONFIG_DIR
from pretraining.train import train
with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
    train(compose("train", overrides={overrides!r}))
print(" ".join(sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = done.stdout.splitlines()[-1].split()
    assert "pretraining.models.transformer" in loaded  # the check sees the run's modules
    unused = [name for name in loaded if any(within(name, root) for root in NOT_LOADED_BY_A_PLAIN_RUN)]
    assert unused == []
