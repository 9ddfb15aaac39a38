"""`callbacks=[default,init_from] callbacks.init_from.path=RUN_OR_CHECKPOINT`: a fresh run starts from the weights
of one of the template's checkpoints, for a second stage: a masked-LM or next-token backbone into contrastive
towers, a next-token one into masked-LM, a contrastive model into a contrastive fine-tuning.

The parent is a checkpoint (a file or a sharded directory) or a run directory (its newest verified checkpoint). It
must verify against its sidecar, have been trained with the run's tokenizer (fingerprint), and have a backbone of
the run's class, shapes (vocabulary rows, width, layers, positions, every tensor) and the settings no shape shows
(heads, activation, rotary base and scaling, norm epsilon): a mismatch stops the run at set-up, before any step, in
one line naming the key to set. Its stored config is rebuilt
only from trusted classes. An objective of the parent's class and every tensor's shape takes its whole model (heads
and temperature too); any other, the backbone alone, into the towers `towers` names (a two-tower parent's passage
tower into the passage tower). A resumed run keeps its own checkpoint's weights; the lineage records the parent
(`origin`: path, SHA-256, run, step), and `pretrain-info` shows it, on every later resume too.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from pretraining.callbacks.lineage import trainer_lineage
from pretraining.checkpoint import newest_verified, read_sidecar, sidecar_digest, verify
from pretraining.checkpoint.lineage import CHECKPOINTS
from pretraining.data.contract import training_data
from pretraining.errors import ConfigError, MissingFileError
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import PretrainingObjective
from pretraining.stored import load_checkpoint, stored_config, stored_objective

KEY = "callbacks.init_from"
Towers = Literal["both", "query", "passage"]


class InitFrom(Callback):
    """Load the checkpoint `path` names (or its run's newest) into a fresh run at set-up, before any validation or
    step. `towers`: which of a two-tower contrastive run's backbones take a backbone (`both`, `query`, `passage`).
    `trusted_targets`: modules beyond this package that the parent's stored config may build."""

    key = KEY

    def __init__(self, path: str, towers: Towers = "both", trusted_targets: Sequence[str] = ()) -> None:
        self.path, self.towers, self.trusted_targets = path, towers, tuple(trusted_targets)
        self.origin: dict[str, Any] | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.origin is not None:  # loaded already (a validation before training, then fit)
            return
        lineage = trainer_lineage(trainer)
        if parent := lineage and lineage.parent:
            recorded = read_sidecar(parent).get("lineage", {}).get("origin")
            check_same_origin(self.key, self.path, recorded, parent)
            self.origin = recorded
            return
        self.origin = self.start(trainer, pl_module)  # type: ignore[arg-type]
        rank_zero_info(f"starting from the weights of {self.origin['summary']}")

    def start(self, trainer: Trainer, objective: PretrainingObjective) -> dict[str, Any]:
        """Load the parent into `objective`; its origin record for the lineage (`summary`: what `pretrain-info`
        shows)."""
        given = f"{KEY}.path={self.path}"
        path = parent_checkpoint(self.path, given)
        digest = sidecar_digest(verify(path))
        checkpoint = load_checkpoint(path)
        tokenizer = training_data(trainer, KEY).tokenizer
        if (fingerprint := checkpoint["lineage"]["tokenizer_fingerprint"]) != tokenizer.fingerprint:
            raise ConfigError(
                f"{given} was trained with another tokenizer (fingerprint {fingerprint}, "
                f"this run's is {tokenizer.fingerprint}): its weights read other ids; pass its tokenizer (its run's "
                "`tokenizer=` settings)"
            )
        stored = stored_config(checkpoint, given, self.trusted_targets)
        parent, _ = stored_objective(checkpoint, stored, given, tokenizer)
        pairs = backbone_pairs(parent, objective, self.towers, given)
        config = checkpoint["lineage"]["config"]
        if lineage := trainer_lineage(trainer):
            run_config: dict[str, Any] = lineage.record["config"]  # type: ignore[assignment]
            check_same_settings(parent.backbone, config["model"]["backbone"], run_config["model"]["backbone"], given)
        loaded = load_parent(parent, objective, self.towers, pairs)
        run = f"{config.get('task_name')}/{config.get('run_name')}"
        origin = {
            "given": self.path,
            "init_from": str(path.resolve()),
            "checkpoint_sha256": digest,
            "run": run,
            "step": checkpoint["global_step"],
            "objective": type(parent).__name__,
            "loaded": loaded,
        }
        origin["summary"] = (
            f"{origin['init_from']} ({loaded} of run {run}, {origin['objective']} step {origin['step']})"
        )
        return origin

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault("lineage", {})["origin"] = self.origin


def parent_checkpoint(given: str, source: str) -> Path:
    """The checkpoint `given` names: itself (a file, or a sharded checkpoint's directory), or a run directory's
    newest checkpoint that verifies."""
    path = Path(given)
    if not path.exists():
        raise MissingFileError(f"{source}: no such checkpoint or run; runs keep their checkpoints in {CHECKPOINTS}")
    if (path / "config.json").is_file():
        raise ConfigError(f"{source} is a Hugging Face model directory: start from it with callbacks.init_from_hf")
    if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
        path = path.parent  # the run's checkpoint directory: its run
    if path.is_dir() and (path / "checkpoints").is_dir():
        newest = newest_verified(path / "checkpoints")
        if newest is None:
            raise MissingFileError(
                f"{source}: the run has no checkpoint that verifies against its sidecar; name a run that saved one, "
                "or one of its checkpoints"
            )
        return newest[0]
    return path


Pairs = dict[str, tuple[Backbone, Backbone]]  # side -> (the parent's backbone, the run's that takes it)


def backbone_pairs(parent: PretrainingObjective, objective: PretrainingObjective, towers: Towers, given: str) -> Pairs:
    """Which parent backbone each backbone `towers` names takes (a two-tower parent's passage backbone the passage
    tower's, its query backbone any other), each checked to be of the same class and shapes."""
    parent_towers = tower_backbones(parent, "both", given)
    pairs = {
        side: (parent_towers.get(side, parent.backbone), target)
        for side, target in tower_backbones(objective, towers, given).items()
    }
    for source, target in pairs.values():
        check_same_backbone(source, target, given)
    return pairs


def load_parent(parent: PretrainingObjective, objective: PretrainingObjective, towers: Towers, pairs: Pairs) -> str:
    """Load `parent`'s weights into `objective`: all of them if it is of the same class and shapes, else the
    backbones `pairs` names; what was loaded, in words."""
    if type(parent) is type(objective) and towers == "both" and same_shapes(parent, objective):
        objective.load_state_dict(parent.state_dict())
        return "the whole model"
    for source, target in pairs.values():
        target.load_state_dict(source.state_dict())
    return "the backbone" if len(pairs) == 1 else "the backbone, into both towers"


def tower_backbones(objective: PretrainingObjective, towers: Towers, given: str) -> dict[str, Backbone]:
    """The backbones of `objective` that `towers` names, by side: a two-tower run's query or passage tower, or
    both; a run of one backbone, that one (side "query")."""
    passage: Backbone | None = getattr(objective, "passage_backbone", None)
    if passage is None:
        if towers != "both":
            raise ConfigError(
                f"{KEY}.towers={towers} chooses a tower of a two-tower run, and this run has one backbone: leave "
                f"{KEY}.towers=both, or set model.shared_towers=false"
            )
        return {"query": objective.backbone}
    both = {"query": objective.backbone, "passage": passage}
    return both if towers == "both" else {towers: both[towers]}


# The backbone settings that change what a weight means and no tensor's shape shows (the shapes show the rest).
MEANINGS = ("n_head", "activation", "rope_theta", "rope_scaling", "norm_eps")


def check_same_settings(backbone: Backbone, parent: dict[str, Any], run: dict[str, Any], given: str) -> None:
    """Refuse a parent `backbone` built with other `MEANINGS` than the run's (`parent`, `run`: their
    model.backbone configs; a key one lacks, as an older checkpoint's, is the class's default)."""
    defaults = {name: value.default for name, value in inspect.signature(type(backbone)).parameters.items()}
    for key in (key for key in MEANINGS if key in defaults):
        theirs, ours = parent.get(key, defaults[key]), run.get(key, defaults[key])
        if theirs != ours:
            raise ConfigError(
                f"{given} has a backbone of model.backbone.{key}={theirs} and this run's is {ours}: set "
                f"model.backbone.{key}={theirs}, as the parent's run did"
            )


def check_same_backbone(parent: Backbone, backbone: Backbone, given: str) -> None:
    """Refuse a parent backbone of another class or shape than the run's, naming the first size that differs and
    the key that sets it."""
    if type(parent) is not type(backbone):
        raise ConfigError(
            f"{given} has a {type(parent).__name__} backbone and this run a {type(backbone).__name__}: choose the "
            f"parent's (model/backbone=...), or start from a checkpoint of this backbone"
        )
    sizes = {
        "vocabulary rows": (len(parent.head_weight), len(backbone.head_weight), "model.backbone.pad_vocabulary"),
        "width": (parent.d_model, backbone.d_model, "model.backbone.d_model"),
        "layers": (len(parent.repeated_layers()), len(backbone.repeated_layers()), "model.backbone.n_layer"),
        "positions": (parent.max_seq_len, backbone.max_seq_len, "model.backbone.max_seq_len"),
    }
    shapes_differ = not same_shapes(parent, backbone)
    for name, (theirs, ours, key) in sizes.items():
        if theirs != ours and shapes_differ:
            raise ConfigError(
                f"{given} has a backbone of {theirs} {name} and this run's has {ours}: set {key} as the parent's "
                "run did, or start from a checkpoint of this shape"
            )
    check_same_shapes(parent, backbone, given)
    if parent.parametrization != backbone.parametrization:
        raise ConfigError(
            f"{given} was trained under {parent.parametrization.describe()} and this run builds "
            f"{backbone.parametrization.describe()}: set model.backbone.parametrization, base_width, base_depth and "
            "base_n_head as the parent's run did"
        )


def same_shapes(parent: nn.Module, module: nn.Module) -> bool:
    return shapes(parent) == shapes(module)


def shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def check_same_shapes(parent: nn.Module, module: nn.Module, given: str) -> None:
    """Refuse `parent` unless its tensors have the names and shapes of `module`'s, naming the first that differs."""
    theirs, ours = shapes(parent), shapes(module)
    if theirs == ours:
        return
    name = next(name for name in sorted(theirs.keys() | ours.keys()) if theirs.get(name) != ours.get(name))
    raise ConfigError(
        f"{given}: the backbone's tensor {name} is {theirs.get(name, 'missing')} there and {ours.get(name, 'missing')} "
        "in this run: set model.backbone as the parent's run did (its config: pretrain-info on it)"
    )


def check_same_origin(key: str, given: str, origin: dict[str, Any] | None, checkpoint: Path) -> None:
    """Refuse a `path` that the run being continued did not start from: its checkpoint's weights win, and the
    lineage would name a start that never happened. The parent is named as it was then, or as the same place
    now (it need not exist any more)."""
    if origin and is_origin(given, origin):
        return
    started = f"{key}.path={origin['given']}" if origin else f"no {key} (random weights)"
    raise ConfigError(
        f"{key}.path={given} applies to a fresh run, and this one continues from {checkpoint}, whose run "
        f"started from {started}: pass that to continue it, or resume=never (or another run_name, and no "
        f"ckpt_path) to start afresh from {given}"
    )


def is_origin(given: str, origin: dict[str, Any]) -> bool:
    """Whether `given` names the start of `origin`: as it was named then, or the same place now."""
    return given == origin.get("given") or str(Path(given).resolve()) == origin["init_from"]
