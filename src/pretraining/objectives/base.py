"""What every objective shares: the backbone, optimizer, schedule and clipping
(`pretraining.objectives.optimization`), the training loss, and validation metrics from states reduced over
ranks (sums, never averages of averages, or concatenations).

A new objective subclasses `PretrainingObjective` with `training_loss`, its validation states (to
`__init__`), `validation_update` (per batch) and `validation_metrics` (from the reduced states); it may set
`example_format`, `check_tokenizer`, `pooled_features` and `batch_work`. Training values go in `step_values`
(`LogStepValues`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Annotated, Any, ClassVar, NamedTuple, cast

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from omegaconf import OmegaConf
from torch import nn
from torch.optim import Optimizer
from torchmetrics import Metric, SumMetric

from pretraining.data.contract import training_data
from pretraining.data.formats import ExampleFormat, PackedBlocks
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError
from pretraining.instantiate import build
from pretraining.models.backbone import Backbone, backbones
from pretraining.models.parametrization import check_optimizer
from pretraining.objectives.optimization import check_same_optimizer, clips_unscaled, optimizer_and_schedule
from pretraining.objectives.optimizers import is_muon
from pretraining.objectives.schedules import ScheduleName
from pretraining.objectives.step_values import LogStepValues
from pretraining.plugins import fsdp2_strategy
from pretraining.ranges import Range, checked_ranges

# The ranges of the settings every objective takes (subclasses pass them on as **settings).
WarmupSteps = Annotated[int, Range(ge=0)]
LRRatio = Annotated[float, Range(ge=0, le=1)]
DecaySteps = Annotated[int, Range(ge=1)]
# The validation batches (over ranks and sources) in which a value the objective accumulates was NaN or infinite:
# logged as `val/nonfinite_batches` by every objective, the unit its metrics are updated in.
NONFINITE_BATCHES = "nonfinite_batches"


def sums(*names: str) -> dict[str, Metric]:
    """Float64 running sums, reduced over ranks by addition. A NaN is summed like any value (torchmetrics' default
    drops it, so a validation with NaN batches would read lower than the model is): the sum is NaN."""
    return {name: SumMetric(nan_strategy="disable").set_dtype(torch.float64) for name in names}


class BatchWork(NamedTuple):
    samples: int
    tokens: int
    flops: int


class PretrainingObjective(LightningModule):
    """Base LightningModule: subclasses add only their loss and their metrics."""

    example_format: ClassVar[type] = PackedBlocks  # the examples it trains on (pretraining.data.formats)

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Backbone,
        optimizer: Callable[..., Optimizer],
        warmup_steps: WarmupSteps = 100,
        min_lr_ratio: LRRatio = 0.1,
        schedule: ScheduleName = "cosine",
        decay_steps: DecaySteps = 120,
        validation_state: Mapping[str, Metric] | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        check_optimizer(backbone.parametrization.name, optimizer)
        self.backbone = backbone
        self.optimizer_factory = optimizer
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.schedule, self.decay_steps = schedule, decay_steps  # decay_steps: the wsd schedule's
        self.validation_state = nn.ModuleDict(validation_state or {})
        self.validation_states = nn.ModuleList([self.validation_state])  # one per data source validated
        self.nonfinite_counts = nn.ModuleList(sums(NONFINITE_BATCHES).values())  # one per source too
        # Not `self.compile`: that is nn.Module's method.
        self.compile_blocks, self.model_configured = compile, False
        self.restored_step = 0  # the step of the checkpoint restored into this module, if any
        self.last_validated_step = -1
        # This step's training values (callbacks' too), on the device; logged by `LogStepValues`.
        self.step_values: dict[str, torch.Tensor | float] = {}

    def configure_model(self) -> None:
        """Under FSDP2, shard the model (`pretraining.plugins.fsdp.shard`); with `compile`, compile each
        backbone's `repeated_layers` in place (no wrapper: checkpoint keys stay). Lightning calls it per stage,
        so it acts once."""
        if self.model_configured:
            return
        if self.device_mesh is not None:  # a ModelParallelStrategy's: only such a run loads plugins.fsdp
            from pretraining.plugins.fsdp import ShardingPolicy, shard

            fsdp2 = fsdp2_strategy(self.trainer.strategy)
            shard(self, self.device_mesh["data_parallel"], fsdp2.policy if fsdp2 else ShardingPolicy())
        if self.compile_blocks:
            for layer in (layer for backbone in backbones(self) for layer in backbone.repeated_layers()):
                layer.compile(dynamic=False)  # pretraining shapes are fixed: no dynamic-shape kernels
        self.model_configured = True

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse a tokenizer this objective cannot work with (the default accepts any)."""

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def features(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """Float32 features (batch, width) of padded token ids for probes, in eval mode without gradients."""
        with frozen(self), uncompiled():
            return self.pooled_features(tokens, attend).float()

    def pooled_features(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """What `features` reads: the backbone's final hidden states averaged over the real tokens."""
        return masked_mean(self.backbone(tokens, attend).float(), attend)

    def batch_work(self, batch: dict[str, torch.Tensor]) -> BatchWork:
        """Samples, tokens and training FLOPs of a batch of packed blocks, from its shapes (no device sync)."""
        samples, length = batch["tokens"][:, :-1].shape
        backbone_flops = samples * length * self.backbone.flops_per_token(length)
        head_flops = samples * self.head_positions(length) * self.backbone.head_flops_per_token()
        return BatchWork(samples, samples * length, backbone_flops + head_flops)

    def head_positions(self, length: int) -> int:
        """How many positions of a `length`-token block the language-model head scores in training."""
        return length

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.step_values["train/loss"] = loss.detach()
        return loss

    def configure_callbacks(self) -> list[Callback]:
        """`LogStepValues`, which Lightning runs after the trainer's callbacks (which fill `step_values`) and
        before checkpoint callbacks (which may monitor them); returned once, as Lightning keeps it across stages
        and announces a replacement."""
        trainer_callbacks: list[Callback] = self.trainer.callbacks  # type: ignore[attr-defined]
        return [] if any(isinstance(c, LogStepValues) for c in trainer_callbacks) else [LogStepValues()]

    @property
    def trained_steps(self) -> int:
        """The optimizer steps behind the weights: the trainer's, or a restored checkpoint's outside `fit`."""
        return max(self.global_step, self.restored_step)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restored_step = checkpoint["global_step"]
        check_same_optimizer(checkpoint, is_muon(self.optimizer_factory))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        states = self.source_states(dataloader_idx)
        update = self.validation_update(batch)
        for name, value in update.items():
            cast(Metric, states[name]).update(value)
        cast(Metric, self.nonfinite_counts[dataloader_idx]).update(any_nonfinite(update.values()))

    def source_states(self, source: int) -> nn.ModuleDict:
        """The validation states of a mixture's `source`-th source, made on first use as emptied copies of
        `validation_state` (the first's), in training mode: Lightning warns of modules left in eval mode; and its
        count of non-finite batches."""
        while len(self.validation_states) <= source:
            states = copy.deepcopy(self.validation_state).train()
            for metric in states.values():
                cast(Metric, metric).reset()
            self.validation_states.append(states)
            count = cast(Metric, copy.deepcopy(self.nonfinite_counts[0]).train())  # on the first's device
            count.reset()
            self.nonfinite_counts.append(count)
        return cast(nn.ModuleDict, self.validation_states[source])

    def on_validation_epoch_end(self) -> None:
        per_source = [
            self.computed_metrics(cast(nn.ModuleDict, states), cast(Metric, count))
            for states, count in zip(self.validation_states, self.nonfinite_counts, strict=True)
        ]
        if len(per_source) == 1:
            metrics = per_source[0]
        else:  # each source's, and their mean weighted as the mixture weighs them (weight 0 left out)
            data = training_data(self.trainer, "data")
            weighted = [(source.weight, values) for source, values in zip(data.sources, per_source, strict=True)]
            weighted = [(weight, values) for weight, values in weighted if weight > 0]
            total = sum(weight for weight, _ in weighted)
            metrics = {
                name: torch.stack([weight / total * values[name] for weight, values in weighted]).sum()
                for name in weighted[0][1]
                if all(name in values for _, values in weighted) and name != NONFINITE_BATCHES
            }
            for source, values in zip(data.sources, per_source, strict=True):
                metrics |= {f"{source.name}/{name}": value for name, value in values.items()}
            metrics[NONFINITE_BATCHES] = torch.stack([values[NONFINITE_BATCHES] for values in per_source]).sum()
        self.warn_if_nonfinite(int(metrics[NONFINITE_BATCHES]))
        metrics = {f"val/{name}": value for name, value in metrics.items()}
        counts = {name: metrics.pop(name) for name in list(metrics) if name.endswith(NONFINITE_BATCHES)}
        # Already global: the max over ranks of the same value is that value, and Lightning does not warn.
        self.log_dict(metrics, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log_dict(counts, sync_dist=True, reduce_fx="max")  # off the progress bar, where 0 would say nothing
        # Logged at the step of the weights validated (Lightning's `step` key), wherever the validation runs.
        self.log("step", float(self.trained_steps), sync_dist=True, reduce_fx="max")
        self.last_validated_step = self.trained_steps

    def warn_if_nonfinite(self, batches: int) -> None:
        """Say that `batches` validation batches gave non-finite values, if any did."""
        if batches:
            rank_zero_warn(
                f"validation of step {self.trained_steps}: NaN or infinite values in {batches} of its batches "
                f"(val/{NONFINITE_BATCHES}), so val/loss is NaN or infinite, never lower: the weights, or a setting, "
                f"make non-finite values"
            )

    def computed_metrics(self, states: nn.ModuleDict, nonfinite: Metric) -> dict[str, torch.Tensor]:
        """The validation metrics of one source's states and its count of non-finite batches, reduced over ranks;
        states and count start afresh."""
        metrics = {name: cast(Metric, metric) for name, metric in states.items()}
        totals = {name: metric.compute() for name, metric in metrics.items()}
        computed = self.validation_metrics(totals) | {NONFINITE_BATCHES: nonfinite.compute()}
        for metric in [*metrics.values(), nonfinite]:
            metric.reset()
        return {name: value.float() for name, value in computed.items()}

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        # trainer.max_steps is above warmup_steps (+ decay_steps): see pretraining.run.fit_schedule
        return optimizer_and_schedule(
            self.optimizer_factory,
            self,
            self.trainer,
            self.warmup_steps,
            self.min_lr_ratio,
            schedule=self.schedule,
            decay_steps=self.decay_steps,
        )

    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as the Trainer says (`clips_unscaled`: also under bf16 with a fused optimizer)."""
        if not clips_unscaled(self.trainer.precision_plugin, optimizer, gradient_clip_val, gradient_clip_algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def logged_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Logged metrics (`trainer.callback_metrics`) as floats, without the `step` key of validation rows."""
    return {name: float(value) for name, value in metrics.items() if name != "step"}


def any_nonfinite(values: Iterable[torch.Tensor]) -> torch.Tensor | float:
    """1 if any of the floating-point `values` holds a NaN or an infinity, else 0, on their device (no host sync)."""
    flags = [~value.isfinite().all() for value in values if value.is_floating_point()]
    return torch.stack(flags).any().double() if flags else 0.0


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """`module` in eval mode (no dropout) without gradients; its previous mode back after."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def uncompiled() -> AbstractContextManager[None]:
    """Compiled blocks run eagerly inside: rare calls of varying shapes would each cost a recompilation."""
    return torch.compiler.set_stance("force_eager")


def masked_mean(hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """The mean of `hidden` (batch, length, width) over the positions where `attend` (batch, length) is True."""
    weights = attend[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)


def build_objective(node: Any, examples: ExampleFormat[Any]) -> PretrainingObjective:
    """Instantiate the `model` config for the data's example format and tokenizer, refusing mismatches."""
    size = examples.tokenizer.vocab_size
    given = OmegaConf.select(node, "backbone.vocab_size", throw_on_missing=False)  # None where left `???`
    if given is not None and given != size:
        raise ConfigError(
            f"model.backbone.vocab_size={given}, but the tokenizer has {size} tokens: leave it out (the run sets it "
            "from the tokenizer), or choose the tokenizer (tokenizer=...)"
        )
    objective = build(node, backbone={"vocab_size": size})
    wanted = objective.example_format
    if not isinstance(examples, wanted):
        raise ConfigError(
            f"{type(objective).__name__} trains on {wanted.__name__} examples but the data config makes "
            f"{type(examples).__name__}: choose a data config whose data.format._target_ is "
            f"{wanted.__module__}.{wanted.__qualname__}, or an experiment preset (experiment=clm_tiny, mlm_tiny or "
            f"contrastive_tiny)"
        )
    check_lengths(examples, objective.backbone.max_seq_len)
    objective.check_tokenizer(examples.tokenizer)
    return objective


def check_lengths(examples: ExampleFormat[Any], max_seq_len: int) -> None:
    """Refuse examples longer than the backbone's positions, naming the `data.format` key."""
    for key, length in examples.lengths.items():
        if length > max_seq_len:
            raise ConfigError(
                f"data.format.{key}={length} exceeds model.backbone.max_seq_len={max_seq_len}: "
                f"lower data.format.{key} or raise model.backbone.max_seq_len"
            )
