"""The pre-commit hooks (.pre-commit-config.yaml) install from PyPI, fix what they can, then pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretraining.config import PROJECT_ROOT


@pytest.fixture(scope="session")
def pre_commit_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh hook cache, not ~/.cache/pre-commit: the test proves the hooks install from PyPI alone,
    as on a cold CI machine (that install is most of the test's time: ~25 s here)."""
    return tmp_path_factory.mktemp("pre-commit-home")


def run(command: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRE_COMMIT_HOME": str(home)}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # installs the hooks from PyPI
def test_pre_commit_hooks_fix_files_then_pass(tmp_path: Path, pre_commit_home: Path) -> None:
    for name in (".pre-commit-config.yaml", "pyproject.toml"):  # the hooks, and ruff's settings
        shutil.copy(PROJECT_ROOT / name, tmp_path / name)
    (tmp_path / "messy.py").write_text("import os,sys\nx = {  'a':1 }\nprint( x )\n")
    (tmp_path / "notes.txt").write_text("trailing spaces   \nno final newline")
    git = ["init", "-q"], ["config", "user.email", "test@example.com"], ["config", "user.name", "test"], ["add", "."]
    for command in git:
        subprocess.run(["git", *command], cwd=tmp_path, check=True)
    pre_commit = [sys.executable, "-m", "pre_commit", "run", "--all-files"]

    first = run(pre_commit, tmp_path, pre_commit_home)
    assert first.returncode != 0, first.stdout + first.stderr
    assert (tmp_path / "messy.py").read_text() == 'x = {"a": 1}\nprint(x)\n'  # unused imports gone, formatted
    assert (tmp_path / "notes.txt").read_text() == "trailing spaces\nno final newline\n"

    second = run(pre_commit, tmp_path, pre_commit_home)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("Passed") == 8  # every hook ran on something
