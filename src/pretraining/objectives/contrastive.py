"""Two-tower contrastive learning over (query, passage) pairs, with CLIP or SigLIP loss.

Under data parallelism the negatives come from every rank: each rank gathers the embeddings of all ranks
*with* gradient and scores its own rows against all columns (open_clip's `local_loss` + `gather_with_grad`),
so the gradient equals that of one process on the concatenated batch.

A step's negatives are its micro-batch's, so a large pool needs a large micro-batch: with
`grad_cache_chunk`, the towers embed it `grad_cache_chunk` sequences at a time, each chunk
checkpointed (its activations dropped, then recomputed in backward, one chunk at a time). That is
gradient caching (GradCache, Gao et al. 2021, arXiv 2101.06983) in torch's own terms: the forward
keeps only the embeddings, the loss's backward gives their gradients, and each chunk's re-forward
carries them into the weights; the gradient is that of one forward over the whole batch (with dropout,
of each chunk's own masks, replayed in its recomputation), and the memory that of a chunk plus the
batch's similarity matrix.

With hard negatives (`data.format.hard_negatives`, mined by `pretrain-data negatives`), each pair brings
passages that BM25 found close to its query: every query is scored against all of them too (columns of the
query-to-passage loss; no query is theirs), but for one that is its own passage, mined for another pair.

Validation embeds every validation pair and ranks all candidates for every query, in both directions:
Recall@k and MRR over the whole set (ties count against the model), and CodeSearchNet's MRR over pools of 1000.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchmetrics import CatMetric

from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.tokenizer import PAD_ID
from pretraining.errors import ConfigError
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import BatchWork, PretrainingObjective, masked_mean
from pretraining.ranges import Range, checked_ranges

Count = Annotated[int, Range(ge=1)]
Pooling = Literal["mean", "first"]
Loss = Literal["clip", "sigmoid"]

MAX_LOGIT_SCALE = math.log(100)


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' `x` concatenated in rank order; gradients flow back to the rank that owns each row."""
    if world()[1] == 1:
        return x
    return torch.cat(dist_autograd.all_gather(x))


def gathered(x: torch.Tensor) -> torch.Tensor:
    """All ranks' `x` concatenated in rank order, without gradient."""
    if world()[1] == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world()[1])]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def clip_loss(
    queries: torch.Tensor,
    passages: torch.Tensor,
    all_queries: torch.Tensor,
    all_passages: torch.Tensor,
    scale: torch.Tensor,
    offset: int = 0,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Symmetric InfoNCE of the local rows against all columns; local pair i is global pair offset + i.
    `excluded`: (local rows, columns of `all_passages`) cells left out of the query-to-passage softmax."""
    labels = torch.arange(len(queries), device=queries.device) + offset
    logits = scale * queries @ all_passages.T
    if excluded is not None:
        logits = logits.masked_fill(excluded, float("-inf"))
    query_to_passage = F.cross_entropy(logits, labels)
    passage_to_query = F.cross_entropy(scale * passages @ all_queries.T, labels)
    return (query_to_passage + passage_to_query) / 2


def sigmoid_loss(
    queries: torch.Tensor,
    all_passages: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    offset: int = 0,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """SigLIP: every (query, passage) cell is a binary match/no-match decision; summed, per local query.
    `excluded`: cells left out (as in `clip_loss`)."""
    logits = scale * queries @ all_passages.T + bias
    signs = -torch.ones_like(logits)
    rows = torch.arange(len(queries), device=queries.device)
    signs[rows, rows + offset] = 1.0
    terms = -F.logsigmoid(signs * logits)
    if excluded is not None:
        terms = terms.masked_fill(excluded, 0.0)
    return terms.sum() / len(queries)


def sequence_keys(tokens: torch.Tensor) -> torch.Tensor:
    """An int64 key of each row of token ids: equal rows, equal keys (others differ, but by rare chance)."""
    weights = torch.randint(1, 2**31, (tokens.shape[-1],), generator=torch.Generator().manual_seed(0))
    return (tokens.long() * weights.to(tokens.device)).sum(-1)


def false_negatives(passages: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """(local pairs, all ranks' negatives): where a hard negative is the pair's own passage, mined for another
    pair of the batch (a cell to leave out: scoring it as a negative would push the answer away)."""
    return sequence_keys(passages)[:, None] == gathered(sequence_keys(negatives))[None, :]


def retrieval_ranks(queries: torch.Tensor, candidates: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """1-based rank of candidate i for query i among all candidates; a tie counts against the model, and a
    non-finite score ranks last (a NaN embedding is the worst case: it would otherwise beat every score)."""
    ranks = []
    for start in range(0, len(queries), chunk):
        scores = queries[start : start + chunk] @ candidates.T
        scores = scores.masked_fill(~scores.isfinite(), float("-inf"))
        rows = torch.arange(len(scores), device=scores.device)
        correct = scores[rows, rows + start]  # from the same matmul as the rest: no rounding mismatch
        ranks.append((scores >= correct[:, None]).sum(1))
    return torch.cat(ranks)


def retrieval_metrics(
    queries: torch.Tensor, candidates: torch.Tensor, recall_at: Sequence[int] = (1, 5, 10), pool_size: int = 1000
) -> dict[str, torch.Tensor]:
    """MRR and Recall@k over all candidates, and MRR over consecutive pools of `pool_size`
    (CodeSearchNet's measure) when there are that many."""
    ranks = retrieval_ranks(queries, candidates).double()
    metrics = {"mrr": (1 / ranks).mean(), **{f"recall@{k}": (ranks <= k).double().mean() for k in recall_at}}
    pools = range(0, len(queries) - pool_size + 1, pool_size)
    if pools:
        pooled = [retrieval_ranks(queries[i : i + pool_size], candidates[i : i + pool_size]) for i in pools]
        metrics[f"mrr@{pool_size}"] = (1 / torch.cat(pooled).double()).mean()
    return metrics


def count_nonfinite(*embeddings: torch.Tensor) -> torch.Tensor:
    """How many embeddings (rows) hold a NaN or an infinity, warned about: they rank last in retrieval."""
    count = sum(int((~rows.isfinite()).any(1).sum()) for rows in embeddings)
    if count:
        total = sum(len(rows) for rows in embeddings)
        rank_zero_warn(
            f"{count} of {total} validation embeddings hold NaN or Inf: the retrieval metrics rank them last"
        )
    return torch.tensor(float(count))


class Contrastive(PretrainingObjective):
    """Query and passage towers (one shared backbone, or two), pooled, projected and
    L2-normalised; a learnable log-temperature, clamped to [0, log 100] after every
    optimizer step (and, being a scalar, never weight-decayed)."""

    example_format = TokenizedPairs

    @checked_ranges("model")
    def __init__(
        self,
        backbone: Backbone,
        *,
        embed_dim: Count = 128,
        pooling: Pooling = "mean",
        shared_towers: bool = True,
        loss: Loss = "clip",
        init_logit_scale: float | None = None,
        init_logit_bias: float = -10.0,
        recall_at: Sequence[Count] = (1, 5, 10),
        pool_size: Count = 1000,
        grad_cache_chunk: Count | None = None,
        **settings: Any,
    ) -> None:
        """`grad_cache_chunk`: the most sequences a tower embeds at once in training (None: the whole
        micro-batch). `settings`: what every objective takes (`PretrainingObjective`: optimizer, warmup, ...)."""
        if backbone.causal:
            raise ConfigError("Contrastive needs a bidirectional backbone: set model.backbone.causal=false")
        if pooling not in get_args(Pooling):
            raise ConfigError(f"model.pooling={pooling!r} must be 'mean' or 'first' (the CLS token)")
        if loss not in get_args(Loss):
            raise ConfigError(f"model.loss={loss!r} must be 'clip' (InfoNCE) or 'sigmoid' (SigLIP)")
        # NaN embeddings must reach the metrics (not be dropped, which breaks the rows' alignment),
        # and sample ids stay exact in float64.
        state = {
            "query": CatMetric(nan_strategy="disable"),
            "passage": CatMetric(nan_strategy="disable"),
            "sample_id": CatMetric(nan_strategy="disable").set_dtype(torch.float64),
        }
        super().__init__(backbone, validation_state=state, **settings)
        self.pooling, self.loss, self.recall_at, self.pool_size = pooling, loss, tuple(recall_at), pool_size
        self.grad_cache_chunk = grad_cache_chunk
        self.query_head = nn.Linear(backbone.d_model, embed_dim, bias=False)
        self.passage_backbone: Backbone | None = None
        self.passage_head: nn.Linear | None = None
        if not shared_towers:
            self.passage_backbone = copy.deepcopy(backbone)
            self.passage_backbone.init_weights()
            self.passage_head = nn.Linear(backbone.d_model, embed_dim, bias=False)
        # CLIP starts at temperature 0.07; SigLIP at scale 10 with bias -10 (its paper's values).
        default_scale = math.log(1 / 0.07) if loss == "clip" else math.log(10)
        # Shape (1,), not a scalar: FSDP2 cannot shard 0-d parameters.
        self.logit_scale = nn.Parameter(torch.tensor([default_scale if init_logit_scale is None else init_logit_scale]))
        self.logit_bias = nn.Parameter(torch.tensor([init_logit_bias])) if loss == "sigmoid" else None

    def tower(self, side: str) -> tuple[Backbone, nn.Linear]:
        """The backbone and projection head that embed `side` ("query" or "passage")."""
        if side == "passage" and self.passage_backbone is not None and self.passage_head is not None:
            return self.passage_backbone, self.passage_head
        return self.backbone, self.query_head

    def encode(self, tokens: torch.Tensor, side: str) -> torch.Tensor:
        """L2-normalised embeddings (batch, embed_dim) of CLS-prefixed, PAD-padded token ids."""
        backbone, head = self.tower(side)
        attend = tokens != PAD_ID
        hidden = backbone(tokens, attend)
        pooled = hidden[:, 0] if self.pooling == "first" else masked_mean(hidden, attend)
        return F.normalize(head(pooled).float(), dim=-1)

    def encode_in_chunks(self, tokens: torch.Tensor, side: str) -> torch.Tensor:
        """`encode`, `grad_cache_chunk` sequences at a time, each chunk recomputed in backward (GradCache)."""
        if self.grad_cache_chunk is None or len(tokens) <= self.grad_cache_chunk:
            return self.encode(tokens, side)
        chunks = tokens.split(self.grad_cache_chunk)
        return torch.cat([checkpoint(self.encode, chunk, side, use_reentrant=False) for chunk in chunks])

    def pooled_features(self, tokens: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """The passage embedding that training shapes (`tokens` CLS-prefixed, as the passages are)."""
        return self.encode(tokens, "passage")

    def pair_loss(
        self,
        queries: torch.Tensor,
        passages: torch.Tensor,
        distributed: bool,
        size_key: str,
        negatives: torch.Tensor | None = None,
        false: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of local embeddings against all ranks' (or, not `distributed`, against each other); with
        `negatives` (hard negatives' embeddings), every query's candidates too, but where `false` (local pairs x
        all negatives) marks the pair's own passage. `size_key`: the config key of the pairs' count, for errors."""
        rank = world()[0] if distributed else 0
        gather = gather_with_grad if distributed else (lambda x: x)
        all_passages = gather(passages)
        if len(all_passages) < 2:
            raise ConfigError(
                f"contrastive learning needs at least 2 pairs (each is the others' negative): raise {size_key}"
            )
        candidates, excluded = all_passages, None
        if negatives is not None and false is not None:
            candidates = torch.cat([all_passages, gather(negatives)])
            excluded = torch.cat([false.new_zeros(len(queries), len(all_passages)), false], 1)
        offset, scale = rank * len(queries), self.logit_scale.exp()
        if self.logit_bias is not None:
            return sigmoid_loss(queries, candidates, scale, self.logit_bias, offset, excluded)
        return clip_loss(queries, passages, gather(queries), candidates, scale, offset, excluded)

    def batch_work(self, batch: dict[str, torch.Tensor]) -> BatchWork:
        """Both towers' tokens (padding included: it is computed) and FLOPs; the projections and the
        similarity matrix are left out (well under 1 % at any useful size)."""
        sides = [(batch[side].shape, self.tower(side)[0]) for side in ("query", "passage")]
        if "negatives" in batch:
            sides.append((batch["negatives"].flatten(0, 1).shape, self.tower("passage")[0]))
        tokens = sum(samples * length for (samples, length), _ in sides)
        flops = sum(samples * length * backbone.flops_per_token(length) for (samples, length), backbone in sides)
        return BatchWork(len(batch["query"]), tokens, flops)

    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        queries = self.encode_in_chunks(batch["query"], "query")
        passages = self.encode_in_chunks(batch["passage"], "passage")
        if "negatives" not in batch:
            return self.pair_loss(queries, passages, True, "data.global_batch_size")
        tokens = batch["negatives"].flatten(0, 1)  # (pairs x hard_negatives, passage_len)
        negatives = self.encode_in_chunks(tokens, "passage")
        false = false_negatives(batch["passage"], tokens)
        return self.pair_loss(queries, passages, True, "data.global_batch_size", negatives, false)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.step_values["train/logit_scale"] = self.logit_scale.detach().exp().squeeze()
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            self.logit_scale.clamp_(0.0, MAX_LOGIT_SCALE)

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "query": self.encode(batch["query"], "query"),
            "passage": self.encode(batch["passage"], "passage"),
            "sample_id": batch["sample_id"],
        }

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        order = totals["sample_id"].argsort()  # the manifest order, whatever the number of ranks
        queries, passages = totals["query"][order], totals["passage"][order]
        # The loss over the whole validation set: it grows with data.val_size, unlike train/loss.
        metrics = {"loss": self.pair_loss(queries, passages, distributed=False, size_key="data.val_size")}
        metrics["nonfinite_embeddings"] = count_nonfinite(queries, passages)
        for direction, (asked, answers) in {"q2p": (queries, passages), "p2q": (passages, queries)}.items():
            for name, value in retrieval_metrics(asked, answers, self.recall_at, self.pool_size).items():
                metrics[f"{direction}_{name}"] = value
        return metrics
