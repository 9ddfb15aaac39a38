"""Installing: the torch build `make install` picks (CUDA where a driver is, PyPI's elsewhere), the pinned
versions it installs, and the extras: a feature used without its extra says which one to install."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pretraining
from pretraining.config import CONFIG_DIR, PROJECT_ROOT
from pretraining.errors import MissingExtraError
from pretraining.run import check_config

CUDA_BUILDS = ["126", "128", "130"]


def fake_nvidia_smi(bin_dir: Path, cuda: str | None) -> dict[str, str]:
    """An environment whose `nvidia-smi` prints the header of a driver that runs CUDA `cuda`, fails as
    without a driver (""), or is not there (None: it is hidden, should the machine have one)."""
    bin_dir.mkdir(exist_ok=True)
    header = f"| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {cuda}     |"
    body = f"echo '{header}'" if cuda else "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9"
    if cuda is None:
        body = "exit 127"  # as a command not found
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return os.environ | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    ("cuda", "index"),
    [
        ("12.8", "https://download.pytorch.org/whl/cu128"),
        ("12.9", "https://download.pytorch.org/whl/cu128"),  # the newest build the driver runs
        ("13.0", "https://download.pytorch.org/whl/cu130"),
        ("12.4", "https://download.pytorch.org/whl/cpu"),  # older than every build: the CPU one, with a warning
        ("", ""),  # nvidia-smi without a driver it can talk to
        (None, ""),  # no nvidia-smi
    ],
)
def test_the_torch_index_follows_the_driver(tmp_path: Path, cuda: str | None, index: str) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", cuda)
    script = PROJECT_ROOT / "scripts" / "torch_index.sh"
    done = subprocess.run(["bash", str(script), *CUDA_BUILDS], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == index
    assert ("older than every build" in done.stderr) == (cuda == "12.4")


def test_make_install_takes_the_cuda_build_and_the_constraints(tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path / "bin", "12.8")
    dry = ["make", "-n", "-B", "-C", str(PROJECT_ROOT), f"VENV={tmp_path / 'venv'}", "install"]
    commands = subprocess.run(dry, capture_output=True, text=True, env=env, check=True).stdout
    assert 'index="https://download.pytorch.org/whl/cu128"; ' in commands
    assert 'pip install --quiet torch==2.13.0 ${index:+--index-url "$index"}' in commands
    assert '--constraint constraints.txt -e ".[all,dev]"' in commands


def pins() -> dict[str, str]:
    text = (PROJECT_ROOT / "constraints.txt").read_text()
    return dict(line.split("==") for line in text.splitlines() if line.strip() and not line.startswith("#"))


def test_the_constraints_pin_every_dependency_but_torch() -> None:
    """torch and its CUDA packages are not pinned there: TORCH_VERSION and the build choose them."""
    names = {name.lower().replace("_", "-") for name in pins()}
    assert "torch" not in names and not any(name.startswith("nvidia-") for name in names)
    assert {"lightning", "hydra-core", "webdataset", "wandb", "optuna", "matplotlib", "transformers"} <= names


def test_make_install_installed_the_pinned_versions() -> None:
    installed = Path(sys.prefix) / ".installed"  # make install writes the constraints file it used there
    if not installed.is_file() or installed.read_text().strip() != "constraints.txt":
        pytest.skip("this environment was not made by `make install` with constraints.txt")
    assert {name: metadata.version(name) for name in pins()} == pins()


def test_the_tensorboard_logger_without_its_extra_is_refused_first(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("tensorboardX", "tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=clm_tiny", "logger=tensorboard"])
    with pytest.raises(MissingExtraError, match=r"logger=tensorboard needs .* 'tensorboard' extra"):
        check_config(cfg)


def test_the_version_is_pyprojects() -> None:
    (version,) = re.findall(r'^version = "([^"]+)"', (PROJECT_ROOT / "pyproject.toml").read_text(), re.M)
    assert pretraining.__version__ == version
    assert f"## {version} " in (PROJECT_ROOT / "CHANGELOG.md").read_text()  # and the changelog has it
