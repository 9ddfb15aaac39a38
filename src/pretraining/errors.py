"""The errors the template raises for input it cannot use. Each message names the problem and the fix;
a Hydra application prints a `ConfigError` or a `RunLockedError` alone, without a traceback
(HYDRA_FULL_ERROR=1 shows one)."""

from __future__ import annotations

from hydra.errors import CompactHydraException


class ConfigError(ValueError, CompactHydraException):
    """A config value that cannot work; the message names the key and the fix."""


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt or does not fit the run; the message says which and what to do."""


class ShardError(ValueError):
    """Shards that cannot be used as they are; the message names the fix."""


class RunLockedError(RuntimeError, CompactHydraException):
    """A run directory that another job holds; the message names the holder and the way out."""
