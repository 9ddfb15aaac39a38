"""The console commands start without loading torch, Lightning or W&B until they have work to do, and the
classes the schema annotates by name are where it names them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pretraining.report import has_extra
from pretraining.schema import EXTRA_ANNOTATIONS

HEAVY = ("torch", "lightning", "wandb", "webdataset", "matplotlib", "transformers")
# Runs one console command (`module:function`, as pyproject names it) in a fresh interpreter, then names the
# heavy modules it loaded.
PROGRAM = f"""
import atexit, importlib, sys
command, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
module, _, function = command.partition(":")
atexit.register(lambda: print("loaded:", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr))
getattr(importlib.import_module(module), function)()
"""
QUICK = [
    ("pretraining.cli:train", ["--help"]),
    ("pretraining.cli:train", ["experiment=clm_tiny", "--cfg", "job"]),
    ("pretraining.cli:evaluate", ["--help"]),
    ("pretraining.cli:data", ["--help"]),
    ("pretraining.cli:data", ["index", "--help"]),
    ("pretraining.cli:data", ["build"]),  # a usage error: --out is required
    ("pretraining.cli:info", ["--help"]),
    # The extras' commands, those this checkout keeps (a fork may have deleted them).
    *[
        (f"pretraining.extras.{extra}.cli:main", ["--help"])
        for extra in ("hf", "plots", "registry", "sweeps", "goodput", "scaling")
        if has_extra(extra)
    ],
]


def run(command: str, args: list[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    done = subprocess.run([sys.executable, "-c", PROGRAM, command, *args], capture_output=True, text=True, timeout=60)
    return done, done.stderr.splitlines()[-1]


@pytest.mark.parametrize(("command", "args"), QUICK, ids=[" ".join([c.rpartition(".")[2], *a]) for c, a in QUICK])
def test_help_usage_errors_and_printed_configs_load_no_heavy_library(command: str, args: list[str]) -> None:
    done, loaded = run(command, args)
    assert loaded == "loaded: []", done.stderr
    if args == ["build"]:
        assert done.returncode == 2 and "required: --out" in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip(), done.stderr


@pytest.mark.parametrize("name", EXTRA_ANNOTATIONS)
def test_the_classes_the_schema_annotates_by_name_are_there(name: str) -> None:
    module, _, qualname = name.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), qualname, None), type), f"no class {name}"
