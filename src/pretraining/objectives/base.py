"""What every pretraining objective shares: the backbone, AdamW with decay on
matrices only, warmup + cosine schedule, train-loss logging, and validation
metrics computed from states reduced over all ranks (sums, never averages of
averages; or concatenations, for metrics over the whole validation set).

A new objective subclasses `PretrainingObjective` and supplies:
`example_format` (the format of the examples it trains on, `PackedBlocks` by
default), its own settings (the shared ones pass through as `**settings`), the
validation states it keeps (passed to `__init__`), `training_loss`,
`validation_update` (what to add to those states per validation batch) and
`validation_metrics` (what to report from the reduced states). It may override `pooled_features`,
what a probe reads (`pretraining.callbacks.LinearProbe`), and log per-step values with `log_step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Annotated, Any, ClassVar, NamedTuple, cast

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.checkpoint import checkpoint
from torchmetrics import Metric, SumMetric

from pretraining.data.formats import ExampleFormat, PackedBlocks
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError
from pretraining.instantiate import build
from pretraining.models.transformer import Block, Transformer, document_positions
from pretraining.plugins import FSDP2Strategy, ShardingPolicy, shard
from pretraining.ranges import Range, checked_ranges

# The ranges of the settings every objective takes (subclasses pass them on as **settings).
WarmupSteps = Annotated[int, Range(ge=0)]
LRRatio = Annotated[float, Range(ge=0, le=1)]
ChunkTokens = Annotated[int, Range(ge=1)] | None  # null: the head and loss over all tokens at once


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sums(*names: str) -> dict[str, Metric]:
    """Float64 running sums, reduced over ranks by addition."""
    return {name: SumMetric().set_dtype(torch.float64) for name in names}


class PretrainingObjective(LightningModule):
    """Base LightningModule: subclasses add only their loss and their metrics."""

    example_format: ClassVar[type] = PackedBlocks  # the examples it trains on (pretraining.data.formats)

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Transformer,
        optimizer: Callable[..., Optimizer],
        warmup_steps: WarmupSteps = 100,
        min_lr_ratio: LRRatio = 0.1,
        validation_state: Mapping[str, Metric] | None = None,
        compile: bool = False,
        init_from: str | None = None,
        document_masking: bool = False,
        document_positions: bool = False,
    ) -> None:
        """`init_from`: a Hugging Face GPT-2 directory whose weights a fresh run starts from. The run loads
        it (`pretraining.run.starting_weights`), not this constructor: a checkpoint rebuilt from its config
        has its own weights and must not need the directory. `document_masking`: in packed blocks a
        position attends only within its own document; `document_positions`: positions restart at 0 at
        each document."""
        super().__init__()
        if (document_masking or document_positions) and not issubclass(self.example_format, PackedBlocks):
            raise ConfigError(
                f"model.document_masking and model.document_positions apply to packed blocks, and "
                f"{type(self).__name__} trains on {self.example_format.__name__}, where each example is one text: "
                f"leave both false"
            )
        self.document_masking, self.document_positions = document_masking, document_positions
        self.backbone = backbone
        self.optimizer_factory = optimizer
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.validation_state = nn.ModuleDict(validation_state or {})
        # Not `self.compile`: that is nn.Module's method.
        self.compile_blocks, self.model_configured = compile, False
        self.last_validated_step = -1
        self.init_from = init_from
        # This step's global gradient norm, left by a callback that computed it before clipping (NumericalGuard):
        # clipping by norm then scales by it instead of computing it again.
        self.step_gradient_norm: torch.Tensor | None = None
        # This optimizer step's training values (see log_step), the ones the progress bar shows, and the last
        # optimizer step whose end on_train_batch_end has seen.
        self.step_values: dict[str, torch.Tensor | float] = {}
        self.bar_names: set[str] = set()
        self.last_step_ended = 0

    def configure_model(self) -> None:
        """Under FSDP2 (Lightning's `ModelParallelStrategy`), shard the model by the strategy's policy
        (`pretraining.plugins.shard`); then, with `compile`, compile each transformer block in place
        (`nn.Module.compile`: no wrapper, so checkpoint keys stay as they are). Lightning calls this
        for every `validate` and `fit`, so it acts only once."""
        if self.model_configured:
            return
        if self.device_mesh is not None:
            strategy = self.trainer.strategy
            policy = strategy.policy if isinstance(strategy, FSDP2Strategy) else ShardingPolicy()
            shard(self, self.device_mesh["data_parallel"], policy)
        if self.compile_blocks:
            for block in self.modules():
                if isinstance(block, Block):
                    block.compile(dynamic=False)  # pretraining shapes are fixed: no dynamic-shape kernels
        self.model_configured = True

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Refuse a tokenizer this objective cannot work with (the default accepts any)."""

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def scored_inputs(self, batch: dict[str, torch.Tensor], validation: bool = False) -> Scored:
        """What a language-model objective scores in a batch of packed blocks (`Scored`). With `hidden_at`,
        what a distillation needs of its student and teacher."""
        raise NotImplementedError(f"{type(self).__name__} does not score token positions")

    def hidden_at(self, scored: Scored) -> torch.Tensor:
        """The backbone's hidden states of `scored.inputs` at the scored positions."""
        raise NotImplementedError(f"{type(self).__name__} does not score token positions")

    def packed_hidden(self, tokens: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The backbone's hidden states of packed `tokens`, whose `documents` are each token's document
        (None: each row is one): attending within documents with `document_masking`, positions restarting
        with `document_positions`."""
        if documents is None:
            if self.document_masking or self.document_positions:
                raise ConfigError(
                    "model.document_masking and model.document_positions need each batch's doc_ids, which "
                    "PackedBlocks makes, and this batch has none: give your example format doc_ids or leave both false"
                )
            return self.backbone(tokens)
        return self.backbone(
            tokens,
            documents=documents if self.document_masking else None,
            position_ids=document_positions(documents) if self.document_positions else None,
        )

    def features(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """Float32 features (batch, width) of PAD-padded token ids (`attend` False at padding) for probes,
        computed in eval mode without gradients; the module's mode is restored after."""
        with frozen(self), uncompiled():
            return self.pooled_features(tokens, attend).float()

    def pooled_features(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """What `features` reads: the backbone's final hidden states averaged over the real tokens."""
        return masked_mean(self.backbone(tokens, attend).float(), attend)

    def batch_work(self, batch: dict[str, torch.Tensor]) -> BatchWork:
        """Samples, tokens and training FLOPs of a batch of packed blocks, from its shapes alone (no
        device sync; `Throughput` works it out once for each set of shapes); the head scores
        `head_positions` of each block."""
        samples, length = batch["tokens"][:, :-1].shape
        backbone_flops = samples * length * self.backbone.flops_per_token(length)
        head_flops = samples * self.head_positions(length) * self.backbone.head_flops_per_token()
        return BatchWork(samples, samples * length, backbone_flops + head_flops)

    def head_positions(self, length: int) -> int:
        """How many positions of a `length`-token block the language-model head scores in training."""
        return length

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_loss(batch)
        self.log_step({"train/loss": loss}, prog_bar=True)
        return loss

    def log_step(self, metrics: Mapping[str, torch.Tensor | float], prog_bar: bool = False) -> None:
        """Log training `metrics` of this optimizer step, numbers or one-element tensors (under gradient
        accumulation, the last micro-batch's value of each). At the steps whose logs are kept (`logs_written_at`)
        they enter `trainer.callback_metrics` at once, as with `self.log`, and go to the loggers (and, with
        `prog_bar`, to the progress bar) at the step's end, with those of a step where training stops
        (preemption). Not through `self.log`: on a CPU each value logged that way costs about 0.6 ms, and
        Lightning's bookkeeping of logged values 0.1 ms at every step; use `self.log` for its other options
        (`sync_dist`, `on_epoch`)."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise ValueError(
                    f"log_step: {name} must be one number, not a tensor of shape {tuple(value.shape)}: "
                    f"log a reduction of it (its .mean(), say)"
                )
            self.step_values[name] = value.detach() if isinstance(value, torch.Tensor) else value
        if prog_bar:
            self.bar_names.update(metrics)
        trainer = self._trainer  # None outside a Trainer (a test, a script)
        if trainer is not None and logs_written_at(trainer, self.last_step_ended + 1):  # the step under way
            # For this step's callbacks (a ModelCheckpoint monitoring train/loss), still on the device: no sync.
            trainer.callback_metrics.update({name: torch.as_tensor(self.step_values[name]).float() for name in metrics})

    def on_train_start(self) -> None:
        """A subclass that overrides this or `on_train_batch_end` calls `super()`: they write the training logs."""
        self.last_step_ended = self.trainer.global_step
        self.step_values.clear()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Write the step's `log_step` values at its end, after every callback's hook (theirs are in)."""
        trainer = self.trainer
        if trainer.global_step == self.last_step_ended:  # accumulating gradients: the step goes on
            return
        self.last_step_ended = trainer.global_step
        if self.step_values and (logs_written_at(trainer, trainer.global_step) or trainer.should_stop):
            values = self.read_step_values()
            write_logs(trainer, values)
            # Those of a step where training stops too (not logged before its end), now as host values.
            trainer.callback_metrics.update({name: torch.tensor(value) for name, value in values.items()})
            trainer.progress_bar_metrics.update({name: values[name] for name in self.bar_names if name in values})
        self.step_values.clear()

    def read_step_values(self) -> dict[str, float]:
        """This step's `log_step` values as numbers, read off the device at once (one sync)."""
        tensors = [
            value.to(self.device, torch.float32).reshape(())
            for value in self.step_values.values()
            if isinstance(value, torch.Tensor)
        ]
        read = iter(torch.stack(tensors).tolist() if tensors else [])
        return {
            name: next(read) if isinstance(value, torch.Tensor) else float(value)
            for name, value in self.step_values.items()
        }

    def bar_values(self) -> dict[str, float]:
        """This step's values that the progress bar shows (`log_step(..., prog_bar=True)`), read off the device."""
        return {name: float(self.step_values[name]) for name in self.bar_names if name in self.step_values}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        for name, value in self.validation_update(batch).items():
            cast(Metric, self.validation_state[name]).update(value)

    def on_validation_epoch_end(self) -> None:
        states = {name: cast(Metric, metric) for name, metric in self.validation_state.items()}
        totals = {name: metric.compute() for name, metric in states.items()}  # reduced over ranks
        for metric in states.values():
            metric.reset()
        metrics = {f"val/{name}": value.float() for name, value in self.validation_metrics(totals).items()}
        # Already global: the max over ranks of the same value is that value, and Lightning does not warn.
        self.log_dict(metrics, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.last_validated_step = self.global_step

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        total_steps = self.trainer.max_steps  # above warmup_steps: see run.fit_warmup
        parameters = [p for p in self.parameters() if p.requires_grad]
        # Weight decay on matrices only: not on biases, norms or scalars (such as a temperature).
        groups = [
            {"params": [p for p in parameters if p.dim() >= 2]},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
        ]
        # Under a loss scaler (16-mixed) a fused optimizer unscales inside its step, after the clipping that
        # the Trainer does first: Lightning refuses that, so such a run gets the unfused kernels.
        scaled = getattr(getattr(self.trainer, "precision_plugin", None), "scaler", None) is not None
        clipped = bool(getattr(self.trainer, "gradient_clip_val", None))
        fused = {} if scaled and clipped else fused_if_open(self.optimizer_factory, parameters)
        optimizer = self.optimizer_factory(groups, **fused)
        schedule = partial(
            warmup_cosine, warmup_steps=self.warmup_steps, total_steps=total_steps, min_lr_ratio=self.min_lr_ratio
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip as the Trainer says. Under bf16-mixed there is no loss scale, so the gradients are the true
        ones and clipping before a fused optimizer's step is right; Lightning's MixedPrecision refuses every
        optimizer able to unscale (`_step_supports_amp_scaling`, such as fused AdamW) all the same, so
        clip as full precision does (Precision.clip_gradients: by norm or by value over the optimizer's
        parameters). By norm with `step_gradient_norm` known, no second pass computes it."""
        plugin = self.trainer.precision_plugin
        norm, self.step_gradient_norm = self.step_gradient_norm, None
        algorithm = GradClipAlgorithmType((gradient_clip_algorithm or "norm").lower())
        if norm is not None and gradient_clip_val and algorithm == GradClipAlgorithmType.NORM:
            # The same parameters, in the same order, as Precision.clip_gradients: the same bits as its own pass.
            torch.nn.utils.clip_grads_with_norm_(list(plugin.main_params(optimizer)), float(gradient_clip_val), norm)
            return
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None and gradient_clip_val:
            Precision.clip_gradients(plugin, optimizer, float(gradient_clip_val), algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def write_logs(trainer: Trainer, metrics: Mapping[str, float]) -> None:
    """Write `metrics` to every logger (which write on rank zero only), at the step Lightning writes the logs
    of the current batch at, and save them as Lightning does (a CSV logger keeps its rows in memory until then)."""
    step = trainer.fit_loop.epoch_loop._batches_that_stepped
    for logger in trainer.loggers:
        logger.log_metrics(dict(metrics), step=step)
        logger.save()


def log_step_values(module: LightningModule, metrics: Mapping[str, torch.Tensor | float]) -> None:
    """A callback's training values of this step: `log_step` for an objective, else Lightning's `log_dict`."""
    if isinstance(module, PretrainingObjective):
        module.log_step(metrics)
    else:
        module.log_dict(dict(metrics))


def logs_written_at(trainer: Trainer, step: int) -> bool:
    """Whether the training logs of optimizer step `step` (counted from 1) are written: those of every
    `trainer.log_every_n_steps`-th step, as Lightning's, and of the last, whose values a run reports."""
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]
    return (bool(every) and step % every == 0) or step >= trainer.max_steps  # type: ignore[attr-defined]


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
    """Compiled blocks run eagerly inside: for the rare calls whose shapes vary (a probe's, a sample's
    growing text), each of which would otherwise cost a recompilation (`model.compile`)."""
    return torch.compiler.set_stance("force_eager")


def masked_mean(hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """The mean of `hidden` (batch, length, width) over the positions where `attend` (batch, length) is True."""
    weights = attend[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)


class Scored(NamedTuple):
    """What a language-model objective scores in a batch of packed blocks."""

    inputs: torch.Tensor  # the token ids the model reads (batch, length)
    documents: torch.Tensor | None  # each input token's document in its block (batch, length); None: one per row
    positions: torch.Tensor | None  # the positions scored (batch, k); None: every one
    targets: torch.Tensor  # their targets, IGNORE where a position counts for nothing


def input_documents(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The documents of a batch's input tokens (all but each block's last), if the batch has them: packed
    blocks from the data do (`doc_ids`); a batch made by hand may not, and is then one document a row."""
    documents = batch.get("doc_ids")
    return None if documents is None else documents[:, :-1]


class BatchWork(NamedTuple):
    samples: int
    tokens: int
    flops: int


def fused_if_open(factory: Callable[..., Optimizer], parameters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """`fused=True` when the optimizer config leaves it open (`fused: null`) and every parameter is on
    CUDA: one kernel for the whole update instead of several per tensor."""
    keywords = factory.keywords if isinstance(factory, partial) else {}
    if "fused" in keywords and keywords["fused"] is None and all(p.device.type == "cuda" for p in parameters):
        return {"fused": True}
    return {}


def lm_cross_entropy(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of the head `F.linear(hidden, head)` against `targets`, in float32.

    With `chunk_tokens`, the matmul and the loss run over that many tokens at a time under activation
    checkpointing: the float32 logits (tokens x vocabulary) never exist whole, forward or backward;
    each chunk's are recomputed in backward. The result equals the plain path's up to rounding."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if chunk_tokens is None:
        return F.cross_entropy(F.linear(hidden, head).float(), targets, ignore_index=ignore_index, reduction=reduction)
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)
    total = torch.stack(
        [
            checkpoint(_summed_cross_entropy, part, head, labels, ignore_index, use_reentrant=False)
            for part, labels in chunks
        ]
    ).sum()
    return total if reduction == "sum" else total / (targets != ignore_index).sum()


def _summed_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, head).float(), targets, ignore_index=ignore, reduction="sum")


def build_objective(node: Any, examples: ExampleFormat[Any]) -> PretrainingObjective:
    """Instantiate the `model` config for the data's example format (and its tokenizer), refusing
    mismatches before any work."""
    objective = build(node, backbone={"vocab_size": examples.tokenizer.vocab_size})
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
