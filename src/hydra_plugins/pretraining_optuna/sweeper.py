"""The sweeps extra's Optuna sweeper as Hydra finds it: Hydra looks for sweepers in the `hydra_plugins`
namespace only, and imports every module there when any command starts. This stub names the sweeper
(`pretraining.extras.sweeps.optuna`) and imports it only once a sweep starts. Delete this folder with the
sweeps extra."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper


class OptunaSweeper(Sweeper):
    """Hydra's handle on `pretraining.extras.sweeps.optuna.OptunaSweeper`, which does the work."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def setup(self, **kwargs: Any) -> None:
        from pretraining.extras.sweeps.optuna import OptunaSweeper as Search  # not at every command's start

        self.search = Search(**self.settings)
        self.search.setup(**kwargs)

    def sweep(self, arguments: list[str]) -> Any:
        return self.search.sweep(arguments)
