"""Library messages that ask nothing of the user, filtered where emitted, each by name: install tips, accelerator
lists, Lightning's internal deprecations, banners. `quiet=false` (configs/train.yaml, eval.yaml) shows them all, and
W&B's banners (`WandbRunLogger`), Lightning's validation tables and seed line; its model summary has its own switch,
`trainer.enable_model_summary`. Every rank calls `set_up_messages`: each is a process of its own."""

from __future__ import annotations

import logging
import warnings

# Lightning sends its notices and ours through one logger (`rank_zero_info`): told apart by their start, not level.
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
# Loggers whose INFO lines repeat the run's start ("Initializing distributed: GLOBAL_RANK ...").
CHATTY_LOGGERS = ("lightning.fabric.utilities.distributed", "lightning.pytorch.accelerators.cuda")
# (message, category, module): warnings raised inside libraries about their own code.
LIBRARY_WARNINGS = (
    # Lightning's _pytree subclasses a class torch deprecated: Lightning's to fix, not the user's.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # Lightning asks for more workers on any machine over 2 CPUs, whatever the loader's wait; data.num_workers also
    # sets the data order, and perf/data_wait shows when the loader is the bottleneck.
    (r"The '\w+' does not have many workers", UserWarning, r"lightning\.pytorch\.trainer\.connectors\.data_connector"),
    # Lightning hints at `srun` wherever it is on PATH outside a SLURM task: such a run is outside SLURM on purpose
    # (a SLURM job's ranks are its tasks: scripts/launch_slurm.sh).
    (r"The `srun` command is available on your system", UserWarning, r"lightning\.fabric\.plugins\.environments"),
)


def set_up_messages(quiet: bool) -> None:
    """Each of Lightning's messages once and, with `quiet`, the libraries' messages listed above left out."""
    route_lightning_messages()
    if quiet:
        quiet_libraries()


def route_lightning_messages() -> None:
    """Each of Lightning's messages once: under Hydra, whose root handlers write the console and log file, the
    `lightning` logger's own console handler only repeats them, so it is removed."""
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
