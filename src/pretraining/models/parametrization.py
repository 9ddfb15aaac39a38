"""How a backbone scales with its width and depth (`model.backbone.parametrization`): initialisation, forward
multipliers and each param group's optimizer settings, so that hyperparameters tuned at a small base shape
(`base_width`, `base_depth`) hold at a larger one. At the base shape every rule is the identity: there `mup` and
`completep` train exactly as `standard`, so a sweep at the base shape is a sweep of all three.

With m = d_model / base_width and, for `completep`, m_L = n_layer / base_depth:

- `standard`: the backbones' own rules (N(0, 0.02), GPT-2's residual projections scaled by 1 / sqrt(2 n_layer), one
  learning rate, attention scores by 1 / sqrt(head width)).
- `mup`, width (µP: Yang et al. 2022, "Tensor Programs V", arXiv 2203.03466, Table 3 for Adam, in the form with an
  output multiplier that its `mup` package and EleutherAI's nanoGPT-mup use): the hidden matrices (the 2-D weights
  inside the layers) start at std / sqrt(m) and take AdamW's learning rate / m; embeddings, norms and biases keep
  theirs; the head reads the final hidden states times 1 / m; attention scores are scaled by 1 / head width
  (section 4: queries and keys grow correlated), as sqrt(base head width) / head width so that the base is
  standard's; AdamW's eps / m everywhere (gradients shrink with width).
- `completep`, width and depth (Dey et al. 2025, "Don't be lazy: CompleteP enables compute-efficient deep
  transformers", arXiv 2505.01618, Table 1 with alpha = 1, and its equation 40 for eps, as its reference
  implementation, nanoGPT-mup's completep branch, applies them): `mup`, and each residual branch multiplied by
  1 / m_L; the residual projections start as at base_depth (the multiplier, not the init, scales them in depth); the
  hidden matrices' weight decay x m (their decay times LR stays fixed in width); eps of the layers' parameters
  / (m m_L). The layers' learning rates scale by m_L^(alpha - 1) = 1.

Muon (`model/optimizer=muon`) orthogonalises each hidden matrix's update and scales it by its shape (torch.optim.Muon's
`adjust_lr_fn`), which already meets µP's spectral condition for hidden layers (Yang, Simon and Bernstein 2023,
arXiv 2310.17813: an update of spectral norm ~ sqrt(fan_out / fan_in) x LR, fixed in width); its learning rate is
not scaled, in width or (as AdamW's at alpha = 1) in depth; its `match_rms_adamw` scaling, which grows with the
matrix, is refused. AdamW's share under it follows the rules above. Each kind of parameter is a param group
(`KINDS`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from pretraining.errors import ConfigError

Name = Literal["standard", "mup", "completep"]
NAMES: tuple[Name, ...] = ("standard", "mup", "completep")
KEY = "model.backbone.parametrization"
# The kinds of parameters, each its param group: the backbones' tables (token and position embeddings, a head read
# through the output multiplier), the layers' matrices and vectors (norms, biases), the backbones' other vectors
# (the final norm), and the objective's own: matrices (a contrastive projection, a readout without a multiplier:
# Tensor Programs V's Table 3 output weights, Adam's LR / m) and vectors (a temperature: no rule).
KINDS = ("embeddings", "hidden", "layer_vectors", "vectors", "readouts", "objective_vectors")


@dataclass(frozen=True)
class Parametrization:
    """The rules of one backbone: its name and how far it is from its base shape."""

    name: Name = "standard"
    width_multiplier: float = 1.0  # d_model / base_width
    depth_multiplier: float = 1.0  # n_layer / base_depth (completep)
    head_multiplier: float = 1.0  # head width / base head width
    base_depth: int | None = None  # completep's

    @property
    def output_multiplier(self) -> float:
        """What the head's input is multiplied by."""
        return 1.0 if self.name == "standard" else 1 / self.width_multiplier

    @property
    def branch_multiplier(self) -> float:
        """What each residual branch (attention, MLP) is multiplied by before it is added."""
        return 1 / self.depth_multiplier if self.name == "completep" else 1.0

    def attention_scale(self, head_width: int) -> float | None:
        """The attention scores' scale; None: 1 / sqrt(head width), the kernels' default."""
        if self.name == "standard" or self.head_multiplier == 1:
            return None
        return 1 / (math.sqrt(head_width) * math.sqrt(self.head_multiplier))

    def hidden_std(self, std: float) -> float:
        """The initial std of a hidden matrix whose standard std is `std`."""
        return std if self.name == "standard" else std / math.sqrt(self.width_multiplier)

    def residual_depth(self, n_layer: int) -> int:
        """The depth GPT-2's 1 / sqrt(2 depth) scaling of residual projections counts: completep's base depth."""
        return self.base_depth if self.name == "completep" and self.base_depth else n_layer

    def describe(self) -> str:
        """Its name and how far from the base, in a few words."""
        if self.name == "standard":
            return self.name
        depth = f" and {self.depth_multiplier:g}x its base depth" if self.name == "completep" else ""
        heads = f", heads {self.head_multiplier:g}x as wide as the base's" if self.head_multiplier != 1 else ""
        return f"{self.name} at {self.width_multiplier:g}x its base width{depth}{heads}"

    def record(self) -> dict[str, Any]:
        """What the lineage stores, a resume compares and `pretrain-info` shows (its summary)."""
        fields = ("name", "width_multiplier", "depth_multiplier", "head_multiplier")
        return {field: getattr(self, field) for field in fields} | {"summary": self.describe()}

    def multipliers(self, group: str) -> dict[str, float]:
        """{optimizer setting: multiplier} of a param group named as `parameter_groups` names them."""
        if self.name == "standard" or group in ("muon", "objective_vectors"):
            return {}
        m, m_l = self.width_multiplier, self.depth_multiplier
        if group == "readouts":
            return {"lr": 1 / m, "eps": 1 / m}
        if self.name == "mup":
            return {"lr": 1 / m, "eps": 1 / m} if group == "hidden" else {"eps": 1 / m}
        if group == "hidden":
            return {"lr": 1 / m, "eps": 1 / (m * m_l), "weight_decay": m}
        return {"eps": 1 / (m * m_l)} if group == "layer_vectors" else {"eps": 1 / m}

    def parameter_groups(
        self,
        trained: Sequence[torch.Tensor],
        layers: Sequence[torch.Tensor],
        in_backbones: Sequence[torch.Tensor],
        muon: bool,
    ) -> list[dict[str, Any]]:
        """The param groups of `trained` by kind (`KINDS`, Muon's matrices last), empty ones left out; weight decay on
        matrices only. `layers`: the parameters in the backbones' layers; `in_backbones`: every backbone's."""
        in_layers, owned = {id(p) for p in layers}, {id(p) for p in in_backbones}
        groups: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
        for param in trained:
            matrix = param.dim() >= 2
            if id(param) in in_layers:
                groups["hidden" if matrix else "layer_vectors"].append(param)
            elif id(param) in owned:
                groups["embeddings" if matrix else "vectors"].append(param)
            else:
                groups["readouts" if matrix else "objective_vectors"].append(param)
        made: list[dict[str, Any]] = [{"params": params, "name": kind} for kind, params in groups.items() if params]
        for group in made:
            if group["params"][0].dim() < 2:
                group["weight_decay"] = 0.0
            if group["name"] == "hidden" and muon:
                group |= {"name": "muon", "muon": True}
        return sorted(made, key=lambda group: group["name"] == "muon")

    def scale(self, param_groups: Sequence[dict[str, Any]]) -> None:
        """Apply `multipliers` to an optimizer's groups, once, before its LR schedule reads their rates."""
        for group in param_groups:
            for setting, multiplier in self.multipliers(group.get("name", "")).items():
                group[setting] *= multiplier


STANDARD = Parametrization()


def checked_parametrization(
    name: str,
    d_model: int,
    n_layer: int,
    n_head: int,
    base: tuple[int | None, int | None, int | None],
    head_dim: int | None = None,
) -> Parametrization:
    """The checked rules of a backbone of these sizes from its `base` shape (`base_width`, `base_depth`,
    `base_n_head`; the last None: this run's n_head). A `head_dim` of its own keeps the heads' width at any d_model."""
    if name not in NAMES:
        raise ConfigError(f"{KEY}={name!r} must be one of {', '.join(NAMES)}")
    if name == "standard":
        return STANDARD
    base_width, base_depth, base_n_head = base
    if base_width is None:
        raise ConfigError(
            f"{KEY}={name} scales from a base shape: set model.backbone.base_width to the d_model the hyperparameters "
            f"were tuned at (this run's, {d_model}, where it is the base)"
        )
    if name == "completep" and base_depth is None:
        raise ConfigError(
            f"{KEY}=completep scales depth from a base: set model.backbone.base_depth to the n_layer the "
            f"hyperparameters were tuned at (this run's, {n_layer}, where it is the base)"
        )
    base_n_head = base_n_head or n_head
    if not head_dim and base_width % base_n_head:
        raise ConfigError(
            f"model.backbone.base_width={base_width} does not split into base_n_head={base_n_head} heads: set "
            "model.backbone.base_n_head to the n_head the hyperparameters were tuned with (null: this run's)"
        )
    head_width, base_head = (head_dim, head_dim) if head_dim else (d_model // n_head, base_width // base_n_head)
    return Parametrization(
        cast(Name, name),
        width_multiplier=d_model / base_width,
        depth_multiplier=n_layer / base_depth if name == "completep" and base_depth else 1.0,
        head_multiplier=head_width / base_head,
        base_depth=base_depth if name == "completep" else None,
    )


def scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`x` times a rule's `multiplier`, untouched at 1 (standard runs compute exactly as without rules)."""
    return x if multiplier == 1 else x * multiplier


def check_optimizer(name: str, optimizer: Any) -> None:
    """Refuse an optimizer (a factory or class) whose scaling rules `name` does not know: AdamW's, and Muon's
    (`MuonAdamW` is an AdamW) with its shape scaling `original`."""
    if name == "standard":
        return
    target = getattr(optimizer, "func", optimizer)
    if not (isinstance(target, type) and issubclass(target, torch.optim.AdamW)):
        raise ConfigError(
            f"{KEY}={name} scales AdamW's and Muon's settings, and model.optimizer builds "
            f"{getattr(target, '__name__', target)}, whose rules differ: choose model/optimizer=adamw or muon, or "
            f"{KEY}=standard"
        )
    if getattr(optimizer, "keywords", {}).get("muon_lr_scaling", "original") != "original":
        raise ConfigError(
            f"{KEY}={name} keeps Muon's rate for matrices of any width, which holds for its shape scaling `original`; "
            "model.optimizer.muon_lr_scaling=match_rms_adamw grows with the width: set it to original"
        )


def check_same_parametrization(saved: dict[str, Any] | None, ours: dict[str, Any]) -> None:
    """Refuse to continue a checkpoint's weights and optimizer state under other rules than it was trained with
    (`saved`, `ours`: `record`s; none in a checkpoint from before parametrizations: standard)."""
    saved = saved or STANDARD.record()
    if saved != ours:
        raise ConfigError(
            f"the checkpoint was trained under {KEY}={saved['summary']}, and this run builds {ours['summary']}: "
            f"continue it with the checkpoint's {KEY}, base_width, base_depth and base_n_head, or start a separate "
            "run (run_name=<new name> or resume=never)"
        )
