"""Muon for the hidden matrices, AdamW for everything else, as one optimizer: `MuonAdamW`.

Muon (https://kellerjordan.github.io/posts/muon/) updates a matrix with its orthogonalised gradient momentum,
so no direction dominates; it suits the layers' projections (2-D `layer_parameters`), while embeddings, head,
norms and scalars keep AdamW. One optimizer holds both, so a checkpoint has one state, and the schedule and
`lr_scale` (the key to sweep) scale both LRs. The update is torch.optim.Muon's, but orthogonalised in float32 off CUDA
(`orthogonalisation_dtype`). Muon needs whole matrices: FSDP is refused with it (`pretraining.run.check_config`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Annotated, Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import AdamW, Optimizer

from pretraining.models.backbone import backbones
from pretraining.ranges import Range, checked_ranges

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's (a, b, c): Keller Jordan's, as torch.optim.Muon's
EPS = 1e-7  # what a matrix's norm is clamped to before dividing by it
LRScaling = Literal["original", "match_rms_adamw"]  # torch.optim.Muon's adjust_lr_fn
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegative = Annotated[float, Range(ge=0)]
Beta = Annotated[float, Range(ge=0, lt=1)]


class MuonAdamW(AdamW):
    """AdamW (unfused) on every param group, except those flagged `muon: True`, which Muon updates; the
    `muon_*` settings are their defaults (`muon_lr` scaled per shape by `muon_lr_scaling`, decay times LR).
    `lr_scale` multiplies `lr` and `muon_lr` alike: one key moves both peak LRs."""

    @checked_ranges("model.optimizer")
    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: PositiveFloat = 1e-3,
        betas: tuple[Beta, Beta] = (0.9, 0.999),
        eps: PositiveFloat = 1e-8,
        weight_decay: NonNegative = 0.01,
        muon_lr: PositiveFloat = 0.02,
        muon_weight_decay: NonNegative = 0.0,
        muon_momentum: Annotated[float, Range(ge=0, lt=1)] = 0.95,
        muon_nesterov: bool = True,
        muon_ns_steps: Annotated[int, Range(ge=1, le=99)] = 5,
        muon_lr_scaling: LRScaling = "original",
        lr_scale: PositiveFloat = 1.0,
    ) -> None:
        muon_defaults = {
            "lr": muon_lr * lr_scale,
            "weight_decay": muon_weight_decay,
            "momentum": muon_momentum,
            "nesterov": muon_nesterov,
            "ns_steps": muon_ns_steps,
            "lr_scaling": muon_lr_scaling,
        }
        groups = [muon_defaults | group if group.get("muon") else group for group in params]
        for param in (p for group in groups if group.get("muon") for p in group["params"]):
            if param.dim() != 2:
                raise ValueError("a Muon param group holds a parameter that is not a matrix: give it to AdamW")
            if isinstance(param, DTensor):
                raise ValueError("Muon needs whole matrices, and this one is sharded (FSDP): use AdamW under FSDP")
        # Not fused: a fused step takes the loss scale of 16-mixed inside it, which the Muon groups cannot.
        super().__init__(groups, lr=lr * lr_scale, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Muon's update of its groups, then AdamW's step with their gradients set aside, so it skips them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = [group for group in self.param_groups if group.get("muon")]
        for group in muon_groups:
            self.muon_step(group)
        set_aside = [(param, param.grad) for group in muon_groups for param in group["params"]]
        for param, _ in set_aside:
            param.grad = None
        try:
            super().step()
        finally:
            for param, grad in set_aside:
                param.grad = grad
        return loss

    def muon_step(self, group: dict[str, Any]) -> None:
        """torch.optim.Muon's update of each matrix of one group, orthogonalised in `orthogonalisation_dtype`."""
        lr, momentum = group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                # A step count as in AdamW's states, which AdamW's load_state_dict reads in every state.
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = orthogonalised(update, group["ns_steps"], orthogonalisation_dtype(update.device))
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-lr * shape_scale(param.shape, group["lr_scaling"]))


def shape_scale(shape: torch.Size, scaling: LRScaling) -> float:
    """Muon's LR factor for a matrix of `shape`: torch.optim.Muon's `adjust_lr_fn`."""
    rows, cols = shape[:2]
    return math.sqrt(max(1, rows / cols)) if scaling == "original" else 0.2 * math.sqrt(max(rows, cols))


def orthogonalisation_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (torch's choice), float32 elsewhere: CPUs emulate bfloat16 matmuls, far slower."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def orthogonalised(matrix: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`matrix` with its singular values pushed towards 1 by `steps` quintic Newton-Schulz iterations in
    `dtype` (torch.optim.Muon's `_zeropower_via_newtonschulz`); the coefficients trade exact convergence for
    few steps, and values tiny against the norm stay small."""
    a, b, c = NS_COEFFICIENTS
    wide = matrix.size(0) <= matrix.size(1)  # iterate on the smaller Gram matrix
    x = matrix.to(dtype) if wide else matrix.to(dtype).T
    x = x / x.norm().clamp(min=EPS)  # spectral norm at most 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def layer_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters in every backbone's `repeated_layers` (frozen ones too: `optimization.built_optimizer` keeps
    the trained): not embeddings, head or parameters outside the layers. Muon updates their matrices."""
    return [
        param for backbone in backbones(module) for layer in backbone.repeated_layers() for param in layer.parameters()
    ]


def is_muon(factory: Callable[..., Optimizer]) -> bool:
    """Whether `factory` (a partial or a class) builds a `MuonAdamW`, which wants the hidden matrices apart."""
    target = factory.func if isinstance(factory, partial) else factory
    return isinstance(target, type) and issubclass(target, MuonAdamW)


def muon_parameter_groups(
    matrices: Sequence[torch.Tensor], others: Sequence[torch.Tensor], hidden: Sequence[torch.Tensor]
) -> list[dict[str, Any]]:
    """MuonAdamW's groups, named for the LR monitor: AdamW with decay first (the LR numerics reports), AdamW
    without it, then Muon on the hidden matrices."""
    is_hidden = {id(param) for param in hidden}
    return [
        {"params": [p for p in matrices if id(p) not in is_hidden], "name": "adamw"},
        {"params": list(others), "weight_decay": 0.0, "name": "adamw_no_decay"},
        {"params": [p for p in matrices if id(p) in is_hidden], "name": "muon", "muon": True},
    ]
