"""The private Lightning and Hydra internals the template relies on, one function each, where no public API
does what it needs. Each says why and the versions it was checked on; `tests/test_internals.py` fails with a
message naming the function when a library moves one. Upgrading Lightning or Hydra: start here."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from hydra.core.utils import JobReturn
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import subprocess_script


def install_signal_handlers_instead(trainer: Trainer, install: Callable[[], None]) -> None:
    """Make `trainer` call `install` where it would install its own signal handlers, at the start of each
    stage. Lightning's SIGTERM handler broadcasts to every rank inside the handler (which can hang a DDP
    job), kills the launcher's other ranks, and lets the loop stop with no checkpoint;
    `pretraining.callbacks.preemption.Preemption` saves at the next step boundary instead. No public switch
    turns Lightning's off. Checked on Lightning 2.5.0 to 2.6.6."""
    trainer._signal_connector.register_signal_handlers = install  # type: ignore[method-assign]


def start_ranks_with(command: Callable[[int], tuple[list[str], str]]) -> None:
    """Make Lightning's DDP launcher start a Hydra job's other local ranks with `command(local_rank)`.
    Its own command repeats `sys.argv`: in a multirun every rank would run the whole sweep (`-m`, the lists
    of values) instead of its job, and Lightning offers no hook for it. Checked on Lightning 2.5.0 to 2.6.6."""
    subprocess_script._hydra_subprocess_cmd = command  # type: ignore[assignment]


def shard_every_rank(strategy: ModelParallelStrategy) -> None:
    """Read `data_parallel_size="auto"` with a given `tensor_parallel_size` as every rank left by tensor
    parallelism (world size / tensor_parallel_size), before the strategy builds its device mesh; Lightning
    reads "auto" as the number of nodes (tensor parallelism within a node), which is not FSDP on every GPU,
    and takes no other value before it knows the world size. Checked on Lightning 2.5.0 to 2.6.6."""
    if strategy._data_parallel_size == "auto" and isinstance(strategy._tensor_parallel_size, int):
        strategy._data_parallel_size = strategy.world_size // strategy._tensor_parallel_size


def drop_wandb_anonymous(logger: WandbLogger) -> None:
    """Leave out the `anonymous` argument that Lightning's `WandbLogger` always passes to `wandb.init`, where
    W&B warns at every run that it has no effect. Checked on Lightning 2.5.0 to 2.6.6 with W&B 0.17 to 0.31."""
    settings: dict[str, Any] = logger._wandb_init
    settings.pop("anonymous", None)


def end_training_loaders(trainer: Trainer) -> None:
    """End the training loop's loaders (their worker processes), as Lightning does when training ends. A
    validation inside training that raises ends only the validation loop's (the active loop): the training
    loader's persistent workers, which ignore SIGTERM (`pretraining.data.loader`), would outlive it and
    hang the interpreter's exit, which terminates its children with SIGTERM. No public API ends another
    loop's loaders. Checked on Lightning 2.5.0 to 2.6.6."""
    trainer.fit_loop.teardown()


def failed_job_error(job_return: JobReturn) -> BaseException:
    """The error a failed Hydra job raised. `JobReturn.return_value` gives it only by raising it again, after
    printing a line to stderr that Hydra prints once already: that line is kept out. Public API only (kept
    here with the others of its kind). Checked on Hydra 1.3.2 to 1.3.8."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            value = job_return.return_value
    except BaseException as error:  # the job's, whatever it was
        return error
    raise ValueError(f"the Hydra job did not fail: it returned {value!r}")
