"""Each private Lightning and Hydra internal that `pretraining.internals` relies on is where it expects, on the
installed versions: an upgrade that moves one fails here, naming the function of `pretraining.internals` to
update. (What each one is for is tested where it acts: signals, multirun ranks, FSDP2, W&B, job status.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import subprocess_script

from pretraining import internals


def moved(function: object) -> str:
    return f"Lightning or Hydra moved what pretraining.internals.{function.__name__} relies on: update it"  # type: ignore[attr-defined]


def test_the_trainer_installs_its_signal_handlers_through_the_method_replaced() -> None:
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    connector = getattr(trainer, "_signal_connector", None)
    assert callable(getattr(connector, "register_signal_handlers", None)), moved(
        internals.install_signal_handlers_instead
    )
    assert "register_signal_handlers()" in inspect.getsource(Trainer._run), moved(
        internals.install_signal_handlers_instead
    )


def test_lightnings_launcher_starts_the_ranks_of_a_hydra_job_with_the_command_replaced() -> None:
    assert callable(getattr(subprocess_script, "_hydra_subprocess_cmd", None)), moved(internals.start_ranks_with)
    assert "_hydra_subprocess_cmd(" in inspect.getsource(subprocess_script), moved(internals.start_ranks_with)


def test_model_parallel_strategy_keeps_its_sizes_where_they_are_read() -> None:
    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    sizes = (getattr(strategy, "_data_parallel_size", None), getattr(strategy, "_tensor_parallel_size", None))
    assert sizes == ("auto", 1), moved(internals.shard_every_rank)
    assert "_data_parallel_size" in inspect.getsource(ModelParallelStrategy.setup_environment), moved(
        internals.shard_every_rank
    )


def test_wandb_logger_keeps_the_arguments_of_wandb_init_where_they_are_read(tmp_path: Path) -> None:
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    assert "anonymous" in getattr(logger, "_wandb_init", {}), moved(internals.drop_wandb_anonymous)
    internals.drop_wandb_anonymous(logger)
    assert "anonymous" not in logger._wandb_init


def test_the_trainer_ends_the_training_loaders_through_its_fit_loop() -> None:
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert callable(getattr(getattr(trainer, "fit_loop", None), "teardown", None)), moved(
        internals.end_training_loaders
    )
    internals.end_training_loaders(trainer)  # before any fit: nothing to end, and no error


def test_a_failed_hydra_job_keeps_its_error_where_it_is_read() -> None:
    error = ValueError("the job's error")
    job = JobReturn(status=JobStatus.FAILED, _return_value=error)
    assert internals.failed_job_error(job) is error, moved(internals.failed_job_error)


def test_reading_a_failed_hydra_jobs_error_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    internals.failed_job_error(JobReturn(status=JobStatus.FAILED, _return_value=ValueError("the job's error")))
    assert capsys.readouterr().err == ""


SOURCES = Path(__file__).resolve().parents[1] / "src"
LIBRARIES = ("lightning", "lightning_fabric", "pytorch_lightning", "hydra", "omegaconf")
# Not private: `os._exit`; Hydra's config keys (`_target_`, `_partial_`, ...); Lightning's loops, private
# classes behind public properties, count as private.
PUBLIC_UNDERSCORED = {"_exit"}
LOOPS = {"fit_loop", "validate_loop", "test_loop", "predict_loop"}
MOST_PRIVATE_LINES = 6  # in pretraining.internals: a seventh internal replaces one by a public route


def private_accesses(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` that reach a private attribute of anything but `self` or `cls`, a Lightning
    loop, or import a private name or module of Lightning, Hydra or OmegaConf."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            name, owner = node.attr, node.value
            underscored = name.startswith("_") and not name.endswith("_") and name not in PUBLIC_UNDERSCORED
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            if (underscored and not own) or name in LOOPS:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            names = [*(node.module or "").split("."), *(alias.name for alias in node.names)]
            if any(part.startswith("_") for part in names):
                found.append((node.lineno, f"from {node.module} import ..."))
    return found


def test_only_internals_reaches_private_parts_of_lightning_and_hydra() -> None:
    inside = {line for line, _ in private_accesses(Path(internals.__file__))}
    assert len(inside) <= MOST_PRIVATE_LINES, f"pretraining.internals reaches private parts on {len(inside)} lines"
    outside = {
        f"{path.relative_to(SOURCES)}:{line}: {text}"
        for path in SOURCES.rglob("*.py")
        if path != Path(internals.__file__)
        for line, text in private_accesses(path)
    }
    assert not outside, f"private parts reached outside pretraining.internals (move them there): {sorted(outside)}"
