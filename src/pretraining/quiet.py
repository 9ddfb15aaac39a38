"""The messages of libraries that ask nothing of the user, filtered where they are emitted, each by name.

A run prints what the template says (its start, validation, checkpoints, report) and the progress bar.
What Lightning, torch and W&B print besides carries no action: a tip to install another package, which
accelerators exist, a deprecation inside Lightning's own code, banners. `quiet=false` (a key of
configs/train.yaml and configs/eval.yaml) shows them all: the filters here, W&B's banners
(`WandbRunLogger`), Lightning's validation tables and its seed line. Its model summary has a switch of
its own, `trainer.enable_model_summary` (off: the run's start names the model in one line). Every rank
calls `set_up_messages`: each is a process of its own.
"""

from __future__ import annotations

import logging
import warnings

# Lightning sends its notices and ours through one logger (`rank_zero_info`), so these are told apart by
# how they begin, not silenced by level.
LIGHTNING_NOTICES = (
    "💡 Tip:",  # install litlogger / litmodels
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped: `max_steps=",  # the report says where the run stopped
    "Restoring states from the checkpoint path at",  # the run's start says which checkpoint it resumes
    "Restored all states from the checkpoint at",
    "-" * 100 + "\ndistributed_backend=",  # "... All distributed processes registered. Starting with 2 ..."
)
LIGHTNING_NOTICE_LOGGER = "lightning.pytorch.utilities.rank_zero"
# Loggers whose INFO lines repeat what the run's start says: "Initializing distributed: GLOBAL_RANK ...",
# "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: ...".
CHATTY_LOGGERS = ("lightning.fabric.utilities.distributed", "lightning.pytorch.accelerators.cuda")
# (message, category, module): warnings raised inside libraries about their own code.
LIBRARY_WARNINGS = (
    # Lightning's _pytree subclasses a class torch deprecated: Lightning's to fix, not the user's.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # Lightning asks for more DataLoader workers wherever the machine has more than 2 CPUs (a 16-core GPU
    # machine: "num_workers=15"), whatever the loader's wait; data.num_workers also sets the data order, and
    # the run's perf/data_wait says when the loader is the bottleneck.
    (r"The '\w+' does not have many workers", UserWarning, r"lightning\.pytorch\.trainer\.connectors\.data_connector"),
    # Wherever `srun` is on PATH (a SLURM login node) and the process is not a SLURM task, Lightning's
    # SLURMEnvironment hints at prepending `srun`: a run outside SLURM is one on purpose (a SLURM job's
    # ranks are its tasks: scripts/launch_slurm.sh), and a run under SLURM never gets the hint.
    (r"The `srun` command is available on your system", UserWarning, r"lightning\.fabric\.plugins\.environments"),
)


def set_up_messages(quiet: bool) -> None:
    """Each of Lightning's messages once and, with `quiet`, the libraries' messages listed above left out."""
    route_lightning_messages()
    if quiet:
        quiet_libraries()


def route_lightning_messages() -> None:
    """Each of Lightning's messages once. The `lightning` package gives its logger a console handler of
    its own, whatever else is configured; under Hydra, whose handlers on the root logger write the
    console and the run's log file, that handler only repeats them, so it is removed."""
    if not logging.getLogger().handlers:
        return
    lightning = logging.getLogger("lightning")
    for handler in [h for h in lightning.handlers if type(h) is logging.StreamHandler]:
        lightning.removeHandler(handler)


class ConsoleFormat(logging.Formatter):
    """The console's format (configs/hydra/default.yaml): a message as it is, a warning or error named so;
    the run's log file adds time, logger and level to every line."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"


class DropNotices(logging.Filter):
    """Drops the records that begin like one of `LIGHTNING_NOTICES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().lstrip().startswith(LIGHTNING_NOTICES)


def quiet_libraries() -> None:
    """Filter the libraries' messages listed above in this process (idempotent)."""
    notices = logging.getLogger(LIGHTNING_NOTICE_LOGGER)
    if not any(isinstance(f, DropNotices) for f in notices.filters):
        notices.addFilter(DropNotices())  # on the logger, not a handler: kept out of the run's log file too
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message, category, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
