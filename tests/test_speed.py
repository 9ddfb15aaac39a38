"""Speed features on one process: chunked cross-entropy, block checkpointing, per-block compile, the
optimizer's fused switch, the FLOPs count and the throughput callback."""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset

from pretraining.callbacks.throughput import Throughput, peak_flops
from pretraining.data.loader import WaitTimedLoader
from pretraining.errors import ConfigError
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.language_model import lm_cross_entropy
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.plugins.fsdp import FSDP2Strategy, ShardingPolicy, shard

VOCAB = 100  # padded to 128 rows


def backbone(causal: bool = True, **kwargs: Any) -> Transformer:
    return Transformer(VOCAB, max_seq_len=32, d_model=32, n_layer=2, n_head=2, causal=causal, **kwargs)


def adamw(**kwargs: Any) -> partial:
    return partial(torch.optim.AdamW, lr=1e-3, **kwargs)


def blocks(batch: int, length: int) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(4, VOCAB, (batch, length + 1)), "sample_id": torch.arange(batch)}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_cross_entropy_equals_the_plain_loss_and_gradients(reduction: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 10, 16, requires_grad=True)
    weight = torch.randn(128, 16, requires_grad=True)
    head = partial(F.linear, weight=weight)
    targets = torch.randint(0, 100, (3, 10))
    targets[0, :4] = -100  # ignored positions count in neither the sum nor the mean's denominator
    plain = lm_cross_entropy(hidden, head, targets, reduction)
    expected = torch.autograd.grad(plain, [hidden, weight])
    chunked = lm_cross_entropy(hidden, head, targets, reduction, chunk_tokens=7)  # 30 tokens: 7+7+7+7+2
    grads = torch.autograd.grad(chunked, [hidden, weight])
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=0)
    for grad, reference_grad in zip(grads, expected, strict=True):  # float32 rounding of the summation order only
        torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-6 * reference_grad.abs().max().item())
    reference = F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten(), reduction=reduction)
    assert torch.allclose(plain, reference, rtol=1e-6)


def test_chunked_loss_trains_a_causal_lm_like_the_plain_one() -> None:
    torch.manual_seed(0)
    plain = CausalLM(backbone(), optimizer=adamw())
    chunked = copy.deepcopy(plain)
    chunked.loss_chunk_tokens = 5
    batch = blocks(2, 16)
    losses = [model.training_loss(batch) for model in (plain, chunked)]
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    losses[0].backward(), losses[1].backward()
    for a, b in zip(plain.parameters(), chunked.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_chunk_tokens=0"):
        CausalLM(backbone(), optimizer=adamw(), loss_chunk_tokens=0)


def test_checkpointed_blocks_give_the_same_loss_and_gradients_with_dropout() -> None:
    torch.manual_seed(0)
    plain = CausalLM(backbone(dropout=0.1), optimizer=adamw())
    checkpointed = copy.deepcopy(plain)
    checkpointed.backbone.checkpoint_activations = True
    batch = blocks(2, 16)
    losses = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)  # the same dropout masks; the recomputation must replay them
        losses.append(model.training_loss(batch))
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_compile_is_per_block_in_place_and_keeps_checkpoint_keys() -> None:
    model = CausalLM(backbone(), optimizer=adamw(), compile=True)
    keys = list(model.state_dict())
    model.configure_model()
    model.configure_model()  # Lightning calls it for every fit and validate
    assert list(model.state_dict()) == keys and not any("_orig_mod" in key for key in keys)
    assert all(block._compiled_call_impl is not None for block in model.backbone.blocks)
    assert CausalLM(backbone(), optimizer=adamw()).backbone.blocks[0]._compiled_call_impl is None


def test_the_optimizer_is_fused_only_on_cuda_or_when_asked() -> None:
    model = CausalLM(backbone(), optimizer=adamw(fused=None))
    model.trainer = type("FakeTrainer", (), {"max_steps": 10, "precision_plugin": None, "gradient_clip_val": 1.0})()
    assert not model.configure_optimizers()["optimizer"].defaults["fused"]  # CPU parameters: the default
    model.optimizer_factory = adamw(fused=True)
    assert model.configure_optimizers()["optimizer"].defaults["fused"]


def test_flops_per_token_matches_a_hand_count() -> None:
    d, layers, length, padded_vocab = 32, 2, 16, 128
    model = backbone()
    # Per layer: qkv 3d^2, proj d^2, mlp up and down 4d^2 each: 12 d^2 weights, 6 FLOPs each per token;
    # attention: QK^T and AV, 2 x 2 d length forward, x3 with backward.
    assert model.flops_per_token(length) == 6 * 12 * d * d * layers + 12 * layers * d * length
    assert model.head_flops_per_token() == 6 * padded_vocab * d

    per_token = model.flops_per_token(length)
    work = CausalLM(model, optimizer=adamw()).batch_work(blocks(3, length))
    assert work == (3, 3 * length, 3 * length * (per_token + model.head_flops_per_token()))
    masked = MaskedLM(backbone(causal=False), optimizer=adamw(), mask_rate=0.3).batch_work(blocks(3, length))
    assert masked.flops == 3 * length * per_token + 3 * round(0.3 * length) * model.head_flops_per_token()
    pairs = {"query": torch.ones(4, 8, dtype=torch.long), "passage": torch.ones(4, 24, dtype=torch.long)}
    contrastive = Contrastive(backbone(causal=False), optimizer=adamw(), shared_towers=False)
    expected = 4 * 8 * model.flops_per_token(8) + 4 * 24 * model.flops_per_token(24)
    assert contrastive.batch_work(pairs) == (4, 4 * 8 + 4 * 24, expected)


class Recorder(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step or 0, metrics))


def seven_step_trainer(callbacks: list[Callback], logger: Logger, **options: Any) -> Trainer:
    """A quiet CPU Trainer for 7 steps, logging every other step."""
    return Trainer(
        accelerator="cpu",
        max_steps=7,
        log_every_n_steps=2,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def test_throughput_is_counted_tokens_over_measured_time() -> None:
    """Batches of two shapes, each counted as its own."""
    torch.manual_seed(0)
    model = CausalLM(backbone(), optimizer=adamw())
    batch_list = [blocks(4, 16) if index % 3 else blocks(2, 8) for index in range(7)]
    ticks = itertools.count(step=0.5)  # every clock reading is half a second after the one before
    callback = Throughput(peak_flops=1e9, clock=lambda: next(ticks))
    recorder = Recorder()
    trainer = seven_step_trainer([callback], recorder, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=DataLoader(batch_list, batch_size=None))
    perf = [(step, row) for step, row in recorder.rows if "perf/tokens_per_s" in row]
    # The clock starts at the end of step 1 and is read at steps 2, 4 and 6: 1, 2, 2 steps per half second.
    assert [step for step, _ in perf] == [1, 3, 5]
    for (_, row), batches in zip(perf, [[1], [2, 3], [4, 5]], strict=True):
        work = [model.batch_work(batch_list[index]) for index in batches]
        steps = len(batches)
        assert row["perf/tokens_per_s"] == pytest.approx(sum(w.tokens for w in work) / 0.5)
        assert row["perf/samples_per_s"] == pytest.approx(sum(w.samples for w in work) / 0.5)
        assert row["perf/step_time"] == pytest.approx(0.5 / steps)
        assert row["perf/mfu"] == pytest.approx(sum(w.flops for w in work) / 0.5 / 1e9)
        assert row["perf/tokens_per_s_per_device"] == row["perf/tokens_per_s"]  # one device
        assert row["perf/samples_per_s_per_device"] == row["perf/samples_per_s"]
        assert row["perf/peak_host_memory_gb"] > 0.01  # this process holds torch: tens of MB at least
        assert "perf/data_wait" not in row  # a plain DataLoader does not time its waits
    assert [row["perf/tokens_per_s"] for _, row in perf] == pytest.approx([128, 160, 256])


class Delayed(Dataset):
    """Batches that each take `delay` seconds to produce: a slow data path."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], delay: float) -> None:
        self.batches, self.delay = batches, delay

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.delay)
        return self.batches[index]


def mean_data_wait(delay: float) -> float:
    """The mean `perf/data_wait` of a 7-step run whose loader takes `delay` seconds a batch."""
    torch.manual_seed(0)
    loader = WaitTimedLoader(Delayed([blocks(4, 16) for _ in range(7)], delay), batch_size=None)
    recorder = Recorder()
    trainer = seven_step_trainer([Throughput()], recorder, limit_val_batches=0)
    trainer.fit(CausalLM(backbone(), optimizer=adamw()), train_dataloaders=loader)
    waits = [row["perf/data_wait"] for _, row in recorder.rows if "perf/data_wait" in row]
    assert len(waits) == 3 and all(0.0 <= wait <= 1.0 for wait in waits)
    return statistics.mean(waits)


def test_the_data_wait_fraction_rises_when_the_loader_is_slowed() -> None:
    prompt, slow = mean_data_wait(0.0), mean_data_wait(0.1)
    # A tiny model's step takes milliseconds: a 0.1 s loader leaves it waiting most of the time.
    assert slow > 0.6 and slow > prompt + 0.4, (prompt, slow)


def test_validation_time_is_not_counted() -> None:
    """Validation inside fit (here 100 s a batch, against 1 s a training step) stops the clock."""
    now = [0.0]

    class Clockwork(Callback):  # runs before Throughput: it moves the fake clock
        def on_train_batch_end(self, *args: Any) -> None:
            now[0] += 1.0

        def on_validation_batch_end(self, *args: Any) -> None:
            now[0] += 100.0

    torch.manual_seed(0)
    batch_list = [blocks(4, 16) | {"target_bytes": torch.full((4,), 16)} for _ in range(7)]
    recorder = Recorder()
    clock = Throughput(clock=lambda: now[0])
    trainer = seven_step_trainer([Clockwork(), clock], recorder, val_check_interval=2, num_sanity_val_steps=0)
    loader = DataLoader(batch_list, batch_size=None)
    trainer.fit(
        CausalLM(backbone(), optimizer=adamw()),
        train_dataloaders=loader,
        val_dataloaders=DataLoader(batch_list[:1], batch_size=None),
    )
    step_times = [row["perf/step_time"] for _, row in recorder.rows if "perf/step_time" in row]
    assert len(step_times) == 3 and step_times == pytest.approx([1.0] * 3)


def test_no_peak_is_known_for_a_cpu() -> None:
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_fsdp_refuses_a_model_without_a_backbone_and_a_second_cast() -> None:
    with pytest.raises(ConfigError, match=r"FSDP shards a backbone's layers: Linear has no .*Backbone"):
        shard(torch.nn.Linear(2, 2), mesh=None, policy=ShardingPolicy())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mixed_precision='fp8' must be null, 'bf16' or 'fp16'"):
        ShardingPolicy("fp8")
    strategy = FSDP2Strategy(mixed_precision="bf16", data_parallel_size=1, tensor_parallel_size=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)
    with pytest.raises(ConfigError, match=r"set trainer\.precision=32-true"):
        trainer.strategy.setup_environment()
