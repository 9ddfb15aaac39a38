"""The coordinate check (Yang et al. 2022, "Tensor Programs V", section 7 and figure 5): train a backbone a few
steps at several widths (or depths) and record how large each layer's activations are. Under a parametrization
that transfers, the size of a coordinate stays the same as the model grows; under `standard` with Adam it grows
with width (and with depth), the instability that moves the best learning rate.

Each record is the mean absolute coordinate, after each step, of the token embedding's output (`embedding`), of
each layer's output (the residual stream: `layer 1`..., the last also as `last layer`), and of the logits
(`logits`), on one fixed batch of random tokens: sizes, not losses, are what the check reads."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from pretraining.models.backbone import Backbone
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.optimization import built_optimizer
from pretraining.objectives.optimizers import MuonAdamW

BACKBONES: dict[str, type[Transformer | Llama]] = {"gpt2": Transformer, "llama": Llama}
VOCABULARY = 256
LENGTH = 64
# What the table and the figure show: the first and the last layer of any depth, what comes in and goes out.
SHOWN = ("embedding", "layer 1", "last layer", "logits")


@dataclass(frozen=True)
class Coordinate:
    """One layer's activation size at one step of one model."""

    width: int
    depth: int
    step: int
    layer: str
    size: float  # mean |x| over the batch's coordinates


def optimizer(name: str, lr: float) -> Callable[..., torch.optim.Optimizer]:
    """AdamW at `lr`, or Muon at 20 `lr` (its default ratio, 0.02 to 1e-3) on the hidden matrices and AdamW at `lr`
    on the rest."""
    if name == "adamw":
        return partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if name == "muon":
        return partial(MuonAdamW, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, muon_lr=20 * lr)
    raise ValueError(f"optimizer {name!r}: adamw or muon")


def model(
    backbone: str, parametrization: str, width: int, depth: int, base_width: int, base_depth: int, opt: str, lr: float
) -> CausalLM:
    """A next-token model of `width` and `depth` with 4 heads (wider with width: the base shape has as many),
    under `parametrization` from the base shape."""
    sizes: dict[str, Any] = {"vocab_size": VOCABULARY, "max_seq_len": LENGTH, "d_model": width, "n_layer": depth}
    sizes |= {"n_head": 4, "parametrization": parametrization}
    sizes |= {"base_width": base_width, "base_depth": base_depth}
    if backbone == "llama":
        sizes["output_init"] = "scaled"  # zero output projections would hide the residual branches at step 0
    return CausalLM(BACKBONES[backbone](**sizes), optimizer=optimizer(opt, lr))


def check(
    backbone: str = "llama",
    parametrization: str = "standard",
    optimizer_name: str = "adamw",
    widths: Sequence[int] = (64, 128, 256, 512),
    depths: Sequence[int] = (2,),
    base_width: int = 64,
    base_depth: int = 2,
    steps: int = 4,
    lr: float = 1e-2,
    batch: int = 8,
    seed: int = 0,
) -> list[Coordinate]:
    """The activation sizes of each width x depth after each of `steps` steps (every model from `seed`, on the same
    batch), under a constant learning rate `lr`."""
    tokens = torch.randint(0, VOCABULARY, (batch, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    records: list[Coordinate] = []
    for width in widths:
        for depth in depths:
            torch.manual_seed(seed)
            net = model(backbone, parametrization, width, depth, base_width, base_depth, optimizer_name, lr)
            records += trained_sizes(net, tokens, steps, width, depth)
    return records


def trained_sizes(net: CausalLM, tokens: torch.Tensor, steps: int, width: int, depth: int) -> list[Coordinate]:
    """Train `net` `steps` steps on `tokens`, recording its activation sizes after each."""
    opt = built_optimizer(net.optimizer_factory, net)
    records: list[Coordinate] = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        net.training_loss({"tokens": tokens}).backward()
        opt.step()
        with torch.no_grad():
            sizes = activation_sizes(net, tokens[:, :-1])
        records += [Coordinate(width, depth, step, layer, size) for layer, size in sizes.items()]
    return records


def activation_sizes(net: CausalLM, tokens: torch.Tensor) -> dict[str, float]:
    """{layer: mean |x|} of one forward pass: the embedding's, each layer's and the logits'."""
    backbone = net.backbone
    sizes: dict[str, float] = {}
    modules: list[tuple[str, nn.Module]] = [("embedding", embedding_table(backbone))]
    modules += [(f"layer {index}", layer) for index, layer in enumerate(backbone.repeated_layers(), 1)]
    handles = [module.register_forward_hook(recorder(sizes, name)) for name, module in modules]
    try:
        logits = backbone.logits(backbone(tokens))
    finally:
        for handle in handles:
            handle.remove()
    sizes["last layer"] = sizes[modules[-1][0]]  # the residual stream the final norm reads, at any depth
    sizes["logits"] = logits[..., : backbone.vocab_size].abs().mean().item()
    return sizes


def embedding_table(backbone: Backbone) -> nn.Module:
    if isinstance(backbone, Transformer):
        return backbone.token_embedding
    if isinstance(backbone, Llama):
        return backbone.embed_tokens
    raise TypeError(f"the coordinate check knows the template's backbones, not {type(backbone).__name__}")


def recorder(sizes: dict[str, float], name: str) -> Callable[..., None]:
    def record(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        sizes[name] = output.abs().mean().item()

    return record


def growth(records: Iterable[Coordinate], layer: str, step: int, along: str = "width") -> float:
    """The exponent of a layer's size against width (or depth) at `step`: the slope of log size on log width,
    by least squares. Near 0: flat; 1: proportional."""
    points = [(getattr(r, along), r.size) for r in records if r.layer == layer and r.step == step]
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(size) for _, size in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


def as_rows(records: Iterable[Coordinate]) -> list[dict[str, Any]]:
    return [asdict(record) for record in records]
