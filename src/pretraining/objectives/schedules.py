"""The LR schedules (`model.schedule`), multipliers of every group's LR stepped every optimizer step.

- `cosine`: linear warmup, then cosine decay to `min_lr_ratio` at `trainer.max_steps`, on which its shape
  depends from the first step: a run continued with another `max_steps` changes course.
- `wsd` (warmup-stable-decay, Hägele et al. 2024): warmup, the peak LR, then a 1 - sqrt decay over the last
  `decay_steps`. Before the decay the LR ignores `max_steps`, so a stable-phase checkpoint continues exactly
  with a larger one, or cools down with `trainer.max_steps=<its step + decay_steps>`; one in its decay
  continues only as it began (its state records the decay)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from pretraining.errors import ConfigError

ScheduleName = Literal["cosine", "wsd"]


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, warmup_steps: int, decay_start: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier of step `step` (from 0): warmup, 1, then 1 - sqrt from `decay_start` to `min_lr_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, decay_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - math.sqrt(progress))


class WarmupStableDecay(LambdaLR):
    """`warmup_stable_decay` as a LambdaLR whose state records the decay and the next step's phase; loading
    refuses a state it would not continue exactly (`check_continuation`)."""

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int, decay_steps: int, total_steps: int, min_lr_ratio: float
    ) -> None:
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_start = max(0, total_steps - decay_steps)
        multiplier = partial(
            warmup_stable_decay,
            warmup_steps=warmup_steps,
            decay_start=self.decay_start,
            decay_steps=decay_steps,
            min_lr_ratio=min_lr_ratio,
        )
        super().__init__(optimizer, multiplier)

    def phase(self) -> str:
        """The phase of the next step (`last_epoch` steps are behind the optimizer): warmup, stable or decay."""
        if self.last_epoch >= self.decay_start:
            return "decay"
        return "warmup" if self.last_epoch < self.warmup_steps else "stable"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "phase": self.phase()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_continuation(state_dict, self.decay_start, self.decay_steps)
        # The configured schedule stays (the saved one is the same wherever the steps so far are concerned).
        own = ("warmup_steps", "decay_start", "decay_steps", "phase")
        super().load_state_dict({key: value for key, value in state_dict.items() if key not in own})
        # The restored optimizer holds the saved schedule's next LRs: a cooldown starting now takes this one's.
        for group, base_lr, multiplier in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base_lr * multiplier(self.last_epoch)


def check_continuation(saved: dict[str, Any], decay_start: int, decay_steps: int) -> None:
    """Refuse to continue the saved schedule with a decay under which its trained steps would have differed:
    a checkpoint past its decay's start, or a decay starting before its step."""
    if "decay_start" not in saved:
        raise ConfigError(
            "the checkpoint was trained with model.schedule=cosine: continue it with model.schedule=cosine "
            "(a warmup-stable-decay run starts with model.schedule=wsd)"
        )
    step, saved_start, saved_steps = saved["last_epoch"], saved["decay_start"], saved["decay_steps"]
    if (saved_start, saved_steps) == (decay_start, decay_steps) or step <= min(saved_start, decay_start):
        return
    if step > saved_start:
        raise ConfigError(
            f"the checkpoint (step {step}) is in its LR decay (steps {saved_start} to {saved_start + saved_steps}): "
            f"it continues only with trainer.max_steps={saved_start + saved_steps} model.decay_steps={saved_steps}; "
            f"to train longer, start a new run from a checkpoint of its stable phase (step {saved_start} or "
            "earlier): run_name=<new name> ckpt_path=<that checkpoint> (callbacks.checkpoint.keep_every keeps such "
            "checkpoints)"
        )
    raise ConfigError(
        f"trainer.max_steps={decay_start + decay_steps} with model.decay_steps={decay_steps} starts the LR decay at "
        f"step {decay_start}, before the checkpoint's step {step}: set trainer.max_steps to at least "
        f"{step + decay_steps} ({step + decay_steps}: a cooldown from this checkpoint)"
    )


class WarmupCosine(LambdaLR):
    """`warmup_cosine` as a LambdaLR that refuses a warmup-stable-decay state."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        multiplier = partial(
            warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        )
        super().__init__(optimizer, multiplier)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "decay_start" in state_dict:
            raise ConfigError(
                "the checkpoint was trained with model.schedule=wsd: continue it with model.schedule=wsd (a cosine "
                "run starts with model.schedule=cosine)"
            )
        super().load_state_dict(state_dict)


def lr_schedule(
    optimizer: Optimizer,
    schedule: ScheduleName,
    warmup_steps: int,
    min_lr_ratio: float,
    decay_steps: int,
    total_steps: int,
) -> LRScheduler:
    """The `schedule` of `optimizer`'s learning rates over `total_steps` (`decay_steps`: wsd's only)."""
    if schedule == "wsd":
        return WarmupStableDecay(optimizer, warmup_steps, decay_steps, total_steps, min_lr_ratio)
    return WarmupCosine(optimizer, warmup_steps, total_steps, min_lr_ratio)
