"""The core without its extras: a copy of the repository with every extra deleted as the README's "What to
delete" says trains with `make train`, and the core's tests that can see the extras gone pass there: every
test module imports, every config composes and instantiates, the docs and the commands hold, and no core test
names an extra. (The rest of the core's tests ran in `make test` already: they import, compose and command
nothing of the extras, which these checks catch; running them all again here would double the time.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pretraining.config import PROJECT_ROOT


def deletions() -> list[str]:
    """The `rm` lines of the README's "What to delete" section."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = re.search(r"^## What to delete\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert section, 'the README has no "## What to delete" section'
    blocks = re.findall(r"```bash\n(.*?)```", section[1], re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("rm ")]


def fork_of_this_checkout(fork: Path) -> None:
    """The files of this checkout (tracked, and untracked but not ignored), copied with their times: `make`
    then sees the installed environment as up to date."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (PROJECT_ROOT / name).is_file():
            (fork / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT_ROOT / name, fork / name)


# The core's tests that read what the deletions remove: the config groups, the docs, the commands.
SEES_THE_EXTRAS_GONE = ["tests/test_configs.py", "tests/test_readme.py", "tests/test_cli.py", "tests/test_layers.py"]


@pytest.mark.slow  # a short `make train` and the core's tests that see the extras gone, in a copy: about 4 min
def test_the_core_alone_trains_and_passes_its_tests(tmp_path: Path) -> None:
    fork = tmp_path / "fork"
    fork_of_this_checkout(fork)
    for line in deletions():
        subprocess.run(line, shell=True, cwd=fork, check=True)
    assert not [path for path in (fork / "src" / "pretraining" / "extras").iterdir() if path.is_dir()]
    imports_an_extra = re.compile(r"^\s*(from|import) pretraining\.extras", re.M)
    assert not [path.name for path in (fork / "tests").glob("*.py") if imports_an_extra.search(path.read_text())]
    if (PROJECT_ROOT / "data").is_dir():  # the default shards, if built: else `make train` builds them
        (fork / "data").symlink_to(PROJECT_ROOT / "data")
    venv = PROJECT_ROOT / ".venv"
    # This checkout's environment, with the fork's package first on the path; never reinstalled (-o).
    make = ["make", "-C", str(fork), f"VENV={venv}", "-o", f"{venv}/.installed"]
    env = os.environ | {"PYTHONPATH": str(fork / "src"), "WANDB_MODE": "offline"}
    short = "trainer.max_steps=20 trainer.val_check_interval=10 callbacks.checkpoint.every_n_steps=10 run_name=fork"
    trained = subprocess.run([*make, "train", f"ARGS={short}"], env=env, capture_output=True, text=True, timeout=900)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    assert "val/bpb = " in trained.stdout + trained.stderr
    assert (fork / "logs/train/runs/fork/checkpoints/last.ckpt").is_file()
    core = "-p no:cacheprovider"  # and make test's own marker selection
    collected = subprocess.run(
        [*make, "test", f"ARGS={core} --collect-only -q"], env=env, capture_output=True, text=True, timeout=600
    )
    assert collected.returncode == 0 and " tests collected" in collected.stdout, collected.stdout[-5000:]
    tested = subprocess.run(
        [*make, "test", f"ARGS={core} -q -x {' '.join(SEES_THE_EXTRAS_GONE)}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert tested.returncode == 0, tested.stdout[-5000:]
