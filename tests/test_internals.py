"""Each private Lightning and Hydra internal that `pretraining.internals` relies on is where it expects, on the
installed versions: an upgrade that moves one fails here, naming the function of `pretraining.internals` to
update. (What each one is for is tested where it acts: signals, multirun ranks, FSDP2, W&B, job status.)"""

from __future__ import annotations

import inspect
from pathlib import Path

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


def test_a_failed_hydra_job_keeps_its_error_where_it_is_read() -> None:
    error = ValueError("the job's error")
    job = JobReturn(status=JobStatus.FAILED, _return_value=error)
    assert internals.failed_job_error(job) is error, moved(internals.failed_job_error)
