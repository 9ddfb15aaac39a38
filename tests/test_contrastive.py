"""Contrastive: the losses against their formulas, retrieval metrics against brute force,
the towers, the temperature, learning, and gradients under 2-process data parallelism."""

from __future__ import annotations

import math
import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import fit_batch, free_port
from pretraining.data.formats import PackedBlocks
from pretraining.data.pair_format import TokenizedPairs
from pretraining.data.tokenizer import CLS_ID, PAD_ID, ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.models.transformer import Transformer
from pretraining.objectives import contrastive as contrastive_module
from pretraining.objectives.base import build_objective
from pretraining.objectives.contrastive import (
    MAX_LOGIT_SCALE,
    Contrastive,
    clip_loss,
    count_nonfinite,
    gather_with_grad,
    retrieval_metrics,
    retrieval_ranks,
    sigmoid_loss,
)

VOCAB = 260


def tiny_contrastive(**options: object) -> Contrastive:
    backbone = Transformer(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layer=1, n_head=2, causal=False)
    return Contrastive(backbone, optimizer=partial(torch.optim.AdamW, lr=3e-3), **{"embed_dim": 16, **options})


def unit(rows: int, dim: int = 8, seed: int = 0) -> torch.Tensor:
    return F.normalize(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


def pair_batch(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def side(length: int) -> torch.Tensor:
        tokens = torch.randint(4, VOCAB, (rows, length), generator=generator)
        tokens[:, 0] = CLS_ID
        lengths = torch.randint(3, length + 1, (rows,), generator=generator)
        return tokens.masked_fill(torch.arange(length) >= lengths[:, None], PAD_ID)

    return {"query": side(12), "passage": side(20), "sample_id": torch.arange(rows)}


# --- losses against the formulas ------------------------------------------------------------------


def test_clip_loss_equals_the_formula() -> None:
    q, p, scale = unit(6, seed=1), unit(6, seed=2), torch.tensor(7.5)
    expected = 0.0
    for i in range(6):
        rows = [math.exp(scale * float(q[i] @ p[j])) for j in range(6)]
        cols = [math.exp(scale * float(p[i] @ q[j])) for j in range(6)]
        expected += -math.log(rows[i] / sum(rows)) - math.log(cols[i] / sum(cols))
    expected /= 2 * 6
    assert float(clip_loss(q, p, q, p, scale)) == pytest.approx(expected, rel=1e-5)
    # Local rows 2..3 against all columns are the middle rows of the full loss.
    local = clip_loss(q[2:4], p[2:4], q, p, scale, offset=2)
    expected_local = 0.0
    for i in (2, 3):
        rows = [math.exp(scale * float(q[i] @ p[j])) for j in range(6)]
        cols = [math.exp(scale * float(p[i] @ q[j])) for j in range(6)]
        expected_local += -math.log(rows[i] / sum(rows)) - math.log(cols[i] / sum(cols))
    assert float(local) == pytest.approx(expected_local / 4, rel=1e-5)


def test_sigmoid_loss_equals_the_formula() -> None:
    q, p, scale, bias = unit(5, seed=3), unit(5, seed=4), torch.tensor(10.0), torch.tensor(-10.0)
    expected = 0.0
    for i in range(5):
        for j in range(5):
            sign = 1.0 if i == j else -1.0
            expected += -math.log(1 / (1 + math.exp(-sign * (scale * float(q[i] @ p[j]) + bias))))
    assert float(sigmoid_loss(q, p, scale, bias)) == pytest.approx(expected / 5, rel=1e-5)
    local = sigmoid_loss(q[3:], p, scale, bias, offset=3)
    expected_local = sum(
        -math.log(1 / (1 + math.exp(-(1.0 if i == j else -1.0) * (scale * float(q[i] @ p[j]) + bias))))
        for i in (3, 4)
        for j in range(5)
    )
    assert float(local) == pytest.approx(expected_local / 2, rel=1e-5)


# --- retrieval metrics against brute force ---------------------------------------------------------


def brute_force_ranks(queries: torch.Tensor, candidates: torch.Tensor) -> list[int]:
    ranks = []
    for i in range(len(queries)):
        scores = [float(queries[i] @ candidates[j]) for j in range(len(candidates))]
        ranks.append(sum(score >= scores[i] for score in scores))
    return ranks


def test_retrieval_ranks_and_metrics_equal_brute_force() -> None:
    queries, candidates = unit(230, 4, seed=5), unit(230, 4, seed=6)
    candidates[10] = candidates[11]  # a tie: query 10 and 11 both rank behind their twin
    queries[20] = candidates[20]
    ranks = brute_force_ranks(queries, candidates)
    assert retrieval_ranks(queries, candidates, chunk=64).tolist() == ranks
    assert ranks[10] >= 2 and ranks[11] >= 2
    metrics = retrieval_metrics(queries, candidates, recall_at=(1, 5, 10), pool_size=100)
    assert float(metrics["mrr"]) == pytest.approx(sum(1 / r for r in ranks) / 230)
    for k in (1, 5, 10):
        assert float(metrics[f"recall@{k}"]) == pytest.approx(sum(r <= k for r in ranks) / 230)
    # Pools of 100: two whole pools (the last 30 candidates are left out), each ranked on its own.
    pooled = brute_force_ranks(queries[:100], candidates[:100]) + brute_force_ranks(
        queries[100:200], candidates[100:200]
    )
    assert float(metrics["mrr@100"]) == pytest.approx(sum(1 / r for r in pooled) / 200)
    assert "mrr@1000" not in retrieval_metrics(queries, candidates)


def test_a_nan_embedding_ranks_last_and_is_counted() -> None:
    embeddings = unit(50, 64, seed=7)
    broken = embeddings.clone()
    broken[3] = float("nan")  # one query: it would rank 0 (an infinite MRR) if NaN beat every score
    ranks = retrieval_ranks(broken, embeddings)
    assert int(ranks[3]) == 50 and all(int(rank) == 1 for i, rank in enumerate(ranks) if i != 3)
    assert float(retrieval_metrics(broken, embeddings)["recall@1"]) == pytest.approx(49 / 50)
    nothing = torch.full((50, 64), float("nan"))  # all NaN: the worst model, not a perfect one
    assert float(retrieval_metrics(nothing, nothing)["mrr"]) == pytest.approx(1 / 50)
    infinite = embeddings.clone().index_fill_(0, torch.tensor([7]), float("inf"))
    with pytest.warns(UserWarning, match="2 of 100 validation embeddings hold NaN or Inf: the retrieval metrics rank"):
        assert float(count_nonfinite(broken, infinite)) == 2


def test_perfect_and_constant_embeddings() -> None:
    embeddings = unit(50, 64, seed=7)
    assert float(retrieval_metrics(embeddings, embeddings)["mrr"]) == 1.0
    constant = torch.ones(50, 4) / 2
    metrics = retrieval_metrics(constant, constant)  # every score ties: each query ranks last
    assert float(metrics["recall@10"]) == 0.0
    assert float(metrics["mrr"]) == pytest.approx(1 / 50)


# --- the module -------------------------------------------------------------------------------------


def test_padding_does_not_change_the_embedding() -> None:
    torch.manual_seed(0)
    for pooling in ("mean", "first"):
        model = tiny_contrastive(pooling=pooling).eval()
        short = torch.tensor([[CLS_ID, 50, 60, 70]])
        longer = torch.cat([short, torch.full((1, 6), PAD_ID)], dim=1)
        assert torch.allclose(model.encode(short, "query"), model.encode(longer, "query"), atol=1e-6)
        assert torch.allclose(model.encode(short, "query").norm(dim=-1), torch.ones(1))


def test_shared_and_separate_towers() -> None:
    torch.manual_seed(0)
    shared = tiny_contrastive()
    tokens = pair_batch(3)["query"]
    assert torch.equal(shared.encode(tokens, "query"), shared.encode(tokens, "passage"))
    separate = tiny_contrastive(shared_towers=False)
    assert separate.passage_backbone is not None
    assert not torch.equal(separate.encode(tokens, "query"), separate.encode(tokens, "passage"))
    assert separate.passage_head is not None
    query_tower = {id(p) for module in (separate.backbone, separate.query_head) for p in module.parameters()}
    passage_tower = {
        id(p) for module in (separate.passage_backbone, separate.passage_head) for p in module.parameters()
    }
    assert query_tower.isdisjoint(passage_tower)
    assert shared.passage_backbone is None and shared.passage_head is None


def test_logit_scale_init_clamp_and_no_weight_decay() -> None:
    clip, siglip = tiny_contrastive(), tiny_contrastive(loss="sigmoid")
    assert float(clip.logit_scale) == pytest.approx(math.log(1 / 0.07))
    assert float(siglip.logit_scale) == pytest.approx(math.log(10)) and float(siglip.logit_bias) == -10.0
    assert clip.logit_bias is None
    # configure_optimizers reads the run length, the precision and the clipping
    clip.trainer = SimpleNamespace(max_steps=10, precision_plugin=None, gradient_clip_val=None)
    optimizer = clip.configure_optimizers()["optimizer"]
    (no_decay,) = [g for g in optimizer.param_groups if any(p is clip.logit_scale for p in g["params"])]
    assert no_decay["weight_decay"] == 0.0
    with torch.no_grad():
        clip.logit_scale.fill_(9.0)
    clip.training_loss(pair_batch(4)).backward()
    clip.optimizer_step(0, 0, optimizer)
    assert float(clip.logit_scale) == pytest.approx(MAX_LOGIT_SCALE)
    with torch.no_grad():
        clip.logit_scale.fill_(-1.0)
    clip.optimizer_step(0, 0, optimizer)
    assert float(clip.logit_scale) == 0.0


@pytest.mark.parametrize("loss", ["clip", "sigmoid"])
def test_overfits_a_fixed_batch(loss: str) -> None:
    torch.manual_seed(0)
    model = tiny_contrastive(loss=loss)
    batch = pair_batch(8)
    first = float(model.training_loss(batch))
    last = fit_batch(model, batch, steps=150, lr=3e-3)
    assert last < 0.05 * first, (first, last)
    model.eval()
    with torch.no_grad():
        queries, passages = model.encode(batch["query"], "query"), model.encode(batch["passage"], "passage")
    assert float(retrieval_metrics(queries, passages)["recall@1"]) == 1.0


def test_validation_metrics_are_independent_of_the_order_of_ranks() -> None:
    torch.manual_seed(0)
    model = tiny_contrastive(pool_size=6).eval()
    batch = pair_batch(12)
    with torch.no_grad():  # through the module's own states, two validation batches
        for half in (slice(0, 6), slice(6, 12)):
            model.validation_step({key: value[half] for key, value in batch.items()}, 0)
    totals = {name: metric.compute() for name, metric in model.validation_state.items()}
    assert totals["query"].shape == (12, 16) and totals["sample_id"].tolist() == list(range(12))
    metrics = model.validation_metrics(totals)
    order = torch.cat([torch.arange(0, 12, 2), torch.arange(1, 12, 2)])  # how two ranks' parts concatenate
    shuffled = model.validation_metrics({key: value[order] for key, value in totals.items()})
    assert set(metrics) >= {"loss", "q2p_mrr", "p2q_mrr", "q2p_recall@1", "q2p_recall@10", "q2p_mrr@6"}
    for key, value in metrics.items():
        assert float(shuffled[key]) == pytest.approx(float(value)), key


def test_refuses_bad_settings_and_a_single_pair() -> None:
    causal = Transformer(vocab_size=VOCAB, max_seq_len=16, d_model=16, n_layer=1, n_head=2, causal=True)
    with pytest.raises(ValueError, match=r"model\.backbone\.causal=false"):
        Contrastive(causal, optimizer=partial(torch.optim.AdamW))
    with pytest.raises(ValueError, match=r"model\.pooling='max'"):
        tiny_contrastive(pooling="max")
    with pytest.raises(ValueError, match=r"model\.loss='triplet'"):
        tiny_contrastive(loss="triplet")
    for key, value in [("pool_size", 0), ("embed_dim", 0)]:
        with pytest.raises(ValueError, match=rf"model\.{key}=0 must be at least 1"):
            tiny_contrastive(**{key: value})
    with pytest.raises(ValueError, match=r"model\.recall_at\[1\]=0 must be at least 1"):
        tiny_contrastive(recall_at=(1, 0))
    with pytest.raises(ValueError, match=r"at least 2 pairs.*data\.global_batch_size"):
        tiny_contrastive().training_loss(pair_batch(1))
    single = tiny_contrastive().validation_update(pair_batch(1))
    with pytest.raises(ValueError, match=r"at least 2 pairs.*data\.val_size"):
        tiny_contrastive().validation_metrics(single)


def test_objective_and_data_must_match(compose_train) -> None:
    contrastive = compose_train(experiment="contrastive_tiny")
    blocks, pairs = PackedBlocks(ByteTokenizer(), 64), TokenizedPairs(ByteTokenizer(), 16, 64)
    message = "Contrastive trains on TokenizedPairs examples but the data config makes PackedBlocks: .*TokenizedPairs"
    with pytest.raises(ConfigError, match=message):
        build_objective(contrastive.model, blocks)
    mlm = compose_train(experiment="mlm_tiny")
    with pytest.raises(ConfigError, match="MaskedLM trains on PackedBlocks examples but the data config makes Tok"):
        build_objective(mlm.model, pairs)


# --- GradCache: chunked towers, the same gradient on a fraction of the memory ------------------------


@pytest.mark.parametrize("loss", ["clip", "sigmoid"])
@pytest.mark.parametrize("shared_towers", [True, False])
def test_grad_cache_gives_the_gradient_of_one_forward(loss: str, shared_towers: bool) -> None:
    batch = pair_batch(10, seed=5)
    whole = model_gradients(loss, batch, distributed=False, shared_towers=shared_towers)
    chunked = model_gradients(loss, batch, distributed=False, shared_towers=shared_towers, grad_cache_chunk=3)
    assert chunked.keys() == whole.keys() and whole["backbone.token_embedding.weight"].abs().max() > 0
    for name, gradient in whole.items():
        assert torch.allclose(chunked[name], gradient, atol=1e-6, rtol=1e-4), name


def saved_bytes_in_forward(model: Contrastive, batch: dict[str, torch.Tensor]) -> int:
    """The bytes autograd keeps for backward while the training loss is computed (dropped ones count 0)."""
    kept: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.training_loss(batch)
    return sum(kept)


def test_grad_cache_keeps_no_activations_in_the_forward() -> None:
    batch = pair_batch(32, seed=1)
    torch.manual_seed(0)
    whole = saved_bytes_in_forward(tiny_contrastive(), batch)
    torch.manual_seed(0)
    chunked = saved_bytes_in_forward(tiny_contrastive(grad_cache_chunk=8), batch)
    # What a chunked forward keeps is the loss's: embeddings and the similarity matrix, not the towers'.
    assert chunked < whole / 10, (chunked, whole)


# --- two processes: gradients equal those of one process on the whole batch -----------------------


def gather_without_grad(x: torch.Tensor) -> torch.Tensor:
    """The wrong way, as a negative control: other ranks' rows are constants, only the local one has gradient."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach())
    parts[dist.get_rank()] = x
    return torch.cat(parts)


def model_gradients(
    loss_name: str, batch: dict[str, torch.Tensor], distributed: bool, **options: object
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the module's training loss (averaged over ranks, as DDP does)."""
    torch.manual_seed(0)
    model = tiny_contrastive(loss=loss_name, **options)
    model.training_loss(batch).backward()
    gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    if distributed:
        for gradient in gradients.values():
            dist.all_reduce(gradient)
            gradient /= dist.get_world_size()
    return gradients


def with_negatives(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with 2 hard negatives a pair, one of pair 0's the passage of pair 5 (another rank's, under 2)."""
    negatives = pair_batch(2 * len(batch["query"]), seed=7)["passage"].view(len(batch["query"]), 2, -1)
    negatives[0, 1] = batch["passage"][5]
    return batch | {"negatives": negatives}


def _rank_main(rank: int, world: int, port: int, batch: dict[str, torch.Tensor], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = len(batch["query"]) // world
        mine = {key: value[rank * rows : (rank + 1) * rows] for key, value in batch.items()}
        hard = {key: value[rank * rows : (rank + 1) * rows] for key, value in with_negatives(batch).items()}
        for loss_name in ("clip", "sigmoid"):
            results[(rank, loss_name)] = model_gradients(loss_name, mine, True)
            results[(rank, loss_name, "grad cache")] = model_gradients(loss_name, mine, True, grad_cache_chunk=3)
            results[(rank, loss_name, "negatives")] = model_gradients(loss_name, hard, True, grad_cache_chunk=3)
            contrastive_module.gather_with_grad = gather_without_grad
            results[(rank, loss_name, "no grad")] = model_gradients(loss_name, mine, True)
            contrastive_module.gather_with_grad = gather_with_grad
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_process_gradients_equal_one_process_on_the_concatenated_batch() -> None:
    batch = pair_batch(8, seed=3)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), batch, results), nprocs=2, join=True)
        results = dict(results)
    for loss_name in ("clip", "sigmoid"):
        single = model_gradients(loss_name, batch, distributed=False)
        assert "logit_scale" in single and single["backbone.token_embedding.weight"].abs().max() > 0
        hard = model_gradients(loss_name, with_negatives(batch), distributed=False)
        for rank in (0, 1):
            for ranked, expected in (
                (results[(rank, loss_name)], single),
                (results[(rank, loss_name, "grad cache")], single),
                (results[(rank, loss_name, "negatives")], hard),
            ):
                assert ranked.keys() == expected.keys()
                for name, gradient in expected.items():
                    assert torch.allclose(ranked[name], gradient, atol=1e-6, rtol=1e-4), (loss_name, name)
            # Without the gradient through the gather the gradients are partial: the comparison can fail.
            partial_gradients = results[(rank, loss_name, "no grad")]
            assert not all(torch.allclose(partial_gradients[n], g, atol=1e-5) for n, g in single.items()), loss_name
