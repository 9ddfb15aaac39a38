"""The errors the template raises for input it cannot use, each message naming the problem and the fix. Each is a
`PretrainingError`, which Hydra prints alone, without a traceback (HYDRA_FULL_ERROR=1 shows it), and keeps the builtin
base a caller may catch: `ConfigError` is a `ValueError`, `MissingFileError` a `FileNotFoundError`, `CheckpointError`
a `RuntimeError`."""

from __future__ import annotations

from hydra.errors import CompactHydraException


class PretrainingError(CompactHydraException):
    """Input the template cannot use; the message alone says what and the fix."""


class ConfigError(ValueError, PretrainingError):
    """A config value that cannot work; the message names the key and the fix."""


class MissingExtraError(ConfigError):
    """A feature used without the optional dependencies it needs: an extra of pyproject.toml."""

    def __init__(self, feature: str, extra: str) -> None:
        super().__init__(
            f"{feature} needs the optional dependencies of the '{extra}' extra: pip install 'pretraining[{extra}]' "
            "(or `make install`, which installs every extra)"
        )


class MissingFileError(FileNotFoundError, ConfigError):
    """A file or directory a config value names is not there; the message names the key and the fix."""


class CheckpointError(RuntimeError, PretrainingError):
    """A checkpoint that is incomplete, corrupt or does not fit the run; the message says which and what to do."""


class StorageError(OSError, PretrainingError):
    """A run's write (or read) the file system refused (full disk, read-only directory, lost mount); the message
    says what was kept and how to continue."""


class ShardError(ValueError, PretrainingError):
    """Shards that cannot be used as they are; the message names the fix."""


class RunLockedError(RuntimeError, PretrainingError):
    """A run directory that another job holds; the message names the holder and the way out."""
