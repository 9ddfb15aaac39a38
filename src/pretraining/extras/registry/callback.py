"""Registering a run's checkpoints as it trains (`callbacks=[default,register]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from pretraining.callbacks.checkpoint import StepCheckpoint
from pretraining.checkpoint import keep_for_good, read_sidecar
from pretraining.errors import ConfigError
from pretraining.extras.registry.mirror import mirror_if_online
from pretraining.extras.registry.versions import Registry, check_alias_name

# Metrics where higher is better (`mode: auto`); every other one is a loss, lower is better.
HIGHER_IS_BETTER = ("accuracy", "mrr", "recall")


class RegisterCheckpoints(Checkpoint):
    """After each validation of a saved step, register its checkpoint in the registry: every one
    (`choose: newest`), or one whose `monitor` beats every checkpoint of this run registered before
    (`choose: best`; `mode: auto` takes higher as better for accuracies, MRR and recall, lower for the
    rest); with `alias`, move the alias to it. A registered checkpoint is kept for good (`keep` in its
    sidecar): pruning never removes it. W&B is mirrored to when credentials allow; a W&B failure is a
    warning, never the end of the run.

    It subclasses Lightning's `Checkpoint` for one reason: Lightning runs checkpoint callbacks last, in
    their configured order, so it runs after `StepCheckpoint` has recorded the validation in the sidecar."""

    def __init__(
        self,
        registry_dir: str,
        choose: Literal["newest", "best"] = "best",
        monitor: str | None = "val/bpb",
        mode: Literal["auto", "min", "max"] = "auto",
        alias: str | None = None,
    ) -> None:
        if alias is not None:
            check_alias_name(alias)
        if choose == "best" and not monitor:
            raise ConfigError("callbacks.register.monitor is not set: name the metric that picks the best checkpoint")
        self.registry = Registry(registry_dir)
        self.choose, self.monitor, self.alias = choose, monitor, alias
        higher = mode == "max" or (mode == "auto" and any(word in str(monitor) for word in HIGHER_IS_BETTER))
        self.higher_is_better = higher

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse before the first step what would fail at the first registration."""
        kinds = [type(callback) for callback in trainer.checkpoint_callbacks]
        if StepCheckpoint not in kinds[: kinds.index(type(self))]:
            raise ConfigError(
                "callbacks.register registers what callbacks.checkpoint (StepCheckpoint) saved and validated, so it "
                "comes after it: callbacks=[default,register]"
            )
        if trainer.is_global_zero:
            self.registry.ledger.check_writable()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        saver = next(c for c in trainer.checkpoint_callbacks if isinstance(c, StepCheckpoint))
        path = saver.validated_path
        if path is None:
            return  # the step validated was not saved
        if self.choose == "best" and not self.improves(path):
            return
        keep_for_good(path, f"registered in {self.registry.directory}")  # first: never registered yet pruned
        version, _ = self.registry.register(path, self.alias)
        alias = f" ({self.alias})" if self.alias else ""
        rank_zero_info(f"registered {path.name} as {version.name}{alias} in {self.registry.directory}")
        try:
            mirror_if_online(self.registry)  # without W&B credentials, `pretrain-registry mirror` does it later
        except Exception as error:  # W&B's network and service errors are many; none may stop training
            rank_zero_warn(f"mirroring the registry to W&B failed ({error}); `pretrain-registry mirror` retries it")

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
        if not earlier:
            return True
        value = validation[self.monitor]
        return value > max(earlier) if self.higher_is_better else value < min(earlier)
