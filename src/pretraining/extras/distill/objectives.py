"""Distillation: a student learns from a frozen teacher's distribution as well as from the data,

    loss = alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy,

with `divergence: reverse` for KL(student_T || teacher_T) (mode-seeking). The T^2 keeps the soft
term's gradients at the scale of the hard one as T grows (Hinton et al., 2015). A next-token student
(`Distill`) is taught at every position, a masked-LM student (`DistillMasked`) at its masked
positions, the teacher reading the same (masked) input. Student and teacher logits are computed
`chunk_tokens` positions at a time under activation checkpointing, so neither's float32
(positions x vocabulary) logits exist whole, forward or backward.

The teacher (`model.teacher`: a checkpoint path, or a registry reference where the registry extra is
installed) is loaded, verified and attached when a run sets the student up (`setup`: `teacher.py`), not by
this constructor: a checkpoint rebuilt from its config (evaluation, export) does not need it. A resumed
run takes the teacher its checkpoint's lineage records. It is held outside the module tree
(`FrozenTeacher`): never in the student's state_dict or checkpoints (the lineage records its reference
and digest), never seen by the optimizer, DDP or FSDP2. Under DDP and FSDP2 every rank holds a whole
replica: without gradients or optimizer state a replica costs only its weights, and sharding it would
add an all-gather per block per step for no saving that matters at the sizes a teacher fits one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.checkpoint import checkpoint

from pretraining.callbacks.lineage import trainer_lineage
from pretraining.checkpoint import read_sidecar
from pretraining.extras.distill.teacher import TeacherChoice, load_teacher
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import PretrainingObjective, frozen, sums
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.language_model import IGNORE, ChunkTokens, Head, LanguageModel
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.ranges import Range, checked_ranges

Weight = Annotated[float, Range(ge=0, le=1)]
Temperature = Annotated[float, Range(gt=0)]
Divergence = Literal["forward", "reverse"]


@dataclass
class FrozenTeacher:
    """The teacher, held by the student in this (not in an `nn.Module` attribute), so that nothing of it is
    saved, optimised or wrapped with the student."""

    model: LanguageModel


class Distillation(LanguageModel):
    """What `Distill` and `DistillMasked` share: the teacher, the loss and the validation KL."""

    teacher_kind: ClassVar[type[PretrainingObjective]]  # the objective a teacher must have been trained with

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Backbone,
        *,
        teacher: str | int,
        alpha: Weight = 0.5,
        temperature: Temperature = 2.0,
        divergence: Divergence = "forward",
        kl_chunk_tokens: ChunkTokens = 1024,
        registry_dir: str | None = None,
        allow_tainted: bool = False,
        trusted_targets: Sequence[str] = (),
        **settings: Any,
    ) -> None:
        """`teacher`: a checkpoint path, or a registry reference (alias, version) of the registry in
        `registry_dir`, which must not have tainted it (unless `allow_tainted`); `trusted_targets`: modules
        whose classes the teacher's stored config may build; `settings`: the student objective's (`CausalLM`
        or `MaskedLM`) and what every objective takes."""
        super().__init__(backbone, **settings)
        self.validation_state.update(sums("kl", "kl_positions"))
        # A registry version may come as a number: model.teacher=3.
        self.choice = TeacherChoice(str(teacher), registry_dir, allow_tainted, list(trusted_targets))
        self.alpha, self.temperature, self.divergence = alpha, temperature, divergence
        self.kl_chunk_tokens = kl_chunk_tokens
        self.teacher: FrozenTeacher | None = None
        self.teacher_record: dict[str, Any] | None = None

    def setup(self, stage: str) -> None:
        """Find, verify and attach the teacher before a training run's first validation or step: the one the
        checkpoint it continues from was distilled from (its lineage records it), else `model.teacher`. A
        student evaluated (`pretrain-eval`) is validated without it."""
        lineage = trainer_lineage(self.trainer)
        if self.teacher is not None or lineage is None:
            return
        recorded = read_sidecar(lineage.parent).get("lineage", {}).get("teacher") if lineage.parent else None
        examples = self.trainer.datamodule.format  # type: ignore[attr-defined]
        teacher, self.teacher_record = load_teacher(self.choice, self.teacher_kind, examples, recorded)
        assert isinstance(teacher, LanguageModel)  # a teacher_kind: load_teacher checked it
        self.attach_teacher(FrozenTeacher(teacher))
        named = (
            f" (registry v{self.teacher_record['registry_version']})" if self.teacher_record["registry_version"] else ""
        )
        parameters = sum(parameter.numel() for parameter in teacher.parameters()) / 1e6
        rank_zero_info(
            f"teacher: {type(teacher).__name__}, {parameters:.2f}M parameters, {self.teacher_record['path']}{named}, "
            f"step {self.teacher_record['step']}"
        )

    def attach_teacher(self, teacher: FrozenTeacher) -> None:
        """Give the student its teacher, frozen."""
        teacher.model.eval().requires_grad_(False)
        self.teacher = teacher

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the teacher in the checkpoint's lineage: a resumed run takes it, and `pretrain-info` shows it."""
        checkpoint.setdefault("lineage", {})["teacher"] = self.teacher_record

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.teacher_to_device()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.teacher_to_device()

    def teacher_to_device(self) -> None:
        if self.teacher is not None:
            self.teacher.model.to(self.device)

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.teacher is None:  # only a run's set-up attaches one: a student rebuilt to evaluate does not train
            raise RuntimeError("a Distill objective trains only with its teacher attached (its `setup`)")
        cross_entropy, kl, count = self.batch_sums(batch, self.temperature, validation=False)
        cross_entropy, kl = cross_entropy / count, kl / count
        self.step_values.update({"train/kl": kl.detach(), "train/ce": cross_entropy.detach()})
        return self.alpha * self.temperature**2 * kl + (1 - self.alpha) * cross_entropy

    def batch_sums(
        self, batch: dict[str, torch.Tensor], temperature: float, validation: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed cross-entropy and KL at `temperature` over the scored positions of `batch`, and their count."""
        assert self.teacher is not None
        scored = self.scored_inputs(batch, validation)
        with frozen(self.teacher.model):  # it reads the documents as it was trained to (its own settings)
            teacher_hidden = self.teacher.model.hidden_at(scored)
        cross_entropy, kl = distillation_sums(
            self.hidden_at(scored),
            self.backbone.logits,
            teacher_hidden,
            self.teacher.model.backbone.logits,
            scored.targets,
            self.backbone.vocab_size,
            temperature,
            self.divergence == "reverse",
            self.kl_chunk_tokens,
        )
        return cross_entropy, kl, (scored.targets != IGNORE).sum()

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The student's own validation sums, and its KL to the teacher at temperature 1 (the distributions
        themselves) when the teacher is attached."""
        updates = super().validation_update(batch)
        if self.teacher is None:
            zero = torch.zeros((), device=self.device)
            return {**updates, "kl": zero, "kl_positions": zero}
        _, kl, count = self.batch_sums(batch, 1.0, validation=True)
        return {**updates, "kl": kl, "kl_positions": count}

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        metrics = super().validation_metrics(totals)
        if self.teacher is not None:
            metrics["kl"] = totals["kl"] / totals["kl_positions"]
        return metrics


class Distill(Distillation, CausalLM):
    """A next-token student taught at every position by a next-token teacher."""

    teacher_kind = CausalLM


class DistillMasked(Distillation, MaskedLM):
    """A masked-LM student taught at its masked positions by a masked-LM teacher."""

    teacher_kind = MaskedLM


def distillation_sums(
    hidden: torch.Tensor,
    head: Head,
    teacher_hidden: torch.Tensor,
    teacher_head: Head,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float,
    reverse: bool,
    chunk_tokens: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, summed KL) over the positions whose target is not IGNORE: the student's logits
    `head(hidden)` against `targets` and against the teacher's distribution, from `teacher_head(teacher_hidden)`,
    in float32 (the heads: the backbones' `logits`). With `chunk_tokens`, that many positions at a time under
    activation checkpointing (recomputed in backward)."""
    hidden, teacher_hidden, targets = hidden.flatten(0, -2), teacher_hidden.flatten(0, -2), targets.flatten()
    settings = (vocab_size, temperature, reverse)
    if chunk_tokens is None:
        return _distillation_sums(hidden, head, teacher_hidden, teacher_head, targets, *settings)
    chunks = zip(
        hidden.split(chunk_tokens), teacher_hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True
    )
    parts = [
        checkpoint(_distillation_sums, part, head, teacher_part, teacher_head, labels, *settings, use_reentrant=False)
        for part, teacher_part, labels in chunks
    ]
    return torch.stack([ce for ce, _ in parts]).sum(), torch.stack([kl for _, kl in parts]).sum()


def _distillation_sums(
    hidden: torch.Tensor,
    head: Head,
    teacher_hidden: torch.Tensor,
    teacher_head: Head,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    cross_entropy = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    # The padded vocabulary's rows are no tokens: both distributions are over the real ones.
    student = F.log_softmax(logits[:, :vocab_size] / temperature, dim=-1)
    teacher = F.log_softmax(teacher_head(teacher_hidden)[:, :vocab_size].float() / temperature, dim=-1)
    first, second = (student, teacher) if reverse else (teacher, student)
    kl = (first.exp() * (first - second)).sum(-1)
    return cross_entropy, kl.masked_fill(targets == IGNORE, 0).sum()
