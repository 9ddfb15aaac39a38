"""The console commands start without loading torch, Lightning or W&B until they have work to do, and the
classes the schema annotates by name are where it names them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pretraining.schema import EXTRA_ANNOTATIONS

HEAVY = ("torch", "lightning", "wandb", "webdataset", "matplotlib", "transformers")
# Runs one command of pretraining.cli in a fresh interpreter, then names the heavy modules it loaded.
PROGRAM = f"""
import atexit, sys
from pretraining import cli
command, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
atexit.register(lambda: print("loaded:", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr))
getattr(cli, command)()
"""
QUICK = [
    ("train", ["--help"]),
    ("train", ["experiment=clm_tiny", "--cfg", "job"]),
    ("evaluate", ["--help"]),
    ("data", ["--help"]),
    ("data", ["index", "--help"]),
    ("data", ["build"]),  # a usage error: --out is required
    ("info", ["--help"]),
    ("export", ["--help"]),
    ("plot", ["--help"]),
    ("sweep_report", ["--help"]),
]


def run(command: str, args: list[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    done = subprocess.run([sys.executable, "-c", PROGRAM, command, *args], capture_output=True, text=True, timeout=60)
    return done, done.stderr.splitlines()[-1]


@pytest.mark.parametrize(("command", "args"), QUICK, ids=[" ".join([c, *a]) for c, a in QUICK])
def test_help_usage_errors_and_printed_configs_load_no_heavy_library(command: str, args: list[str]) -> None:
    done, loaded = run(command, args)
    assert loaded == "loaded: []", done.stderr
    if args == ["build"]:
        assert done.returncode == 2 and "required: --out" in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip(), done.stderr


def test_a_misspelt_override_names_the_key_meant() -> None:
    done, _ = run("train", ["experiment=mlm_tiny", "trainer.max_stepz=3", "--cfg", "job"])
    assert done.returncode == 1 and "did you mean trainer.max_steps? Write trainer.max_steps=3" in done.stderr


@pytest.mark.parametrize("name", EXTRA_ANNOTATIONS)
def test_the_classes_the_schema_annotates_by_name_are_there(name: str) -> None:
    module, _, qualname = name.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), qualname, None), type), f"no class {name}"
