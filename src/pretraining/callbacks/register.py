"""Registering a run's checkpoints as it trains (`callbacks=[default,register]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info

from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.checkpoint import keep_for_good, read_sidecar
from pretraining.errors import ConfigError
from pretraining.registry.mirror import mirror_if_online
from pretraining.registry.versions import Registry, check_alias_name


class RegisterCheckpoints(Checkpoint):
    """After each validation of a saved step, register its checkpoint in the registry: every one
    (`choose: newest`), or one whose `monitor` beats every checkpoint of this run registered before
    (`choose: best`, lower is better unless `mode: max`); with `alias`, move the alias to it. A registered
    checkpoint is kept for good (`keep` in its sidecar): pruning never removes it.

    It subclasses Lightning's `Checkpoint` for one reason: Lightning runs checkpoint callbacks last, in
    their configured order, so it runs after `StepCheckpoint` has recorded the validation in the sidecar."""

    def __init__(
        self,
        registry_dir: str,
        choose: Literal["newest", "best"] = "best",
        monitor: str = "val/bpb",
        mode: Literal["min", "max"] = "min",
        alias: str | None = None,
    ) -> None:
        if alias is not None:
            check_alias_name(alias)
        self.registry = Registry(registry_dir)
        self.choose, self.monitor, self.mode, self.alias = choose, monitor, mode, alias

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        saver = trainer.checkpoint_callback
        if trainer.sanity_checking or not trainer.is_global_zero or not isinstance(saver, StepCheckpoint):
            return
        if saver.saved_step != trainer.global_step or not saver.last_model_path:
            return  # this step was not saved
        path = Path(saver.last_model_path)
        if self.choose == "best" and not self.improves(path):
            return
        version, _ = self.registry.register(path, self.alias)
        keep_for_good(path, f"registered as {version.name} in {self.registry.directory}")
        alias = f" ({self.alias})" if self.alias else ""
        rank_zero_info(f"registered {path.name} as {version.name}{alias} in {self.registry.directory}")
        mirror_if_online(self.registry)  # without W&B credentials, `pretrain-registry mirror` does it later

    def improves(self, path: Path) -> bool:
        """Whether the checkpoint's `monitor` beats every checkpoint of its directory registered before."""
        validation = read_sidecar(path).get("validation") or {}
        if self.monitor not in validation:
            raise ConfigError(
                f"callbacks.register.monitor={self.monitor} is not among the validation metrics "
                f"({', '.join(sorted(validation))}): name one of them"
            )
        earlier = [
            version.validation[self.monitor]
            for version in self.registry.state().versions.values()
            if Path(version.path).parent == path.resolve().parent and self.monitor in version.validation
        ]
        best = (min if self.mode == "min" else max)(earlier, default=None)
        value = validation[self.monitor]
        return best is None or (value < best if self.mode == "min" else value > best)
