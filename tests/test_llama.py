"""The Llama backbone: its shapes and names, what attention sees (causal, bidirectional, documents,
grouped-query, QK-norm), the head, its size and refusals, every objective over it, and a real run."""

from __future__ import annotations

import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from conftest import TINY_RUN
from pretraining.data.tokenizer import CLS_ID, PAD_ID
from pretraining.errors import ConfigError
from pretraining.instantiate import check_targets
from pretraining.models.attention import document_positions, multi_head_attention
from pretraining.models.llama import Llama
from pretraining.models.llama_shape import default_mlp_width, parameter_count
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.train import train

VOCAB = 100
SHAPE = {"vocab_size": VOCAB, "max_seq_len": 64, "d_model": 32, "n_layer": 2, "n_head": 4}
adamw = partial(torch.optim.AdamW, lr=1e-3)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def llama(**settings: object) -> Llama:
    """A small Llama with GPT-2's init: zero output projections would hide what the layers compute."""
    torch.manual_seed(0)
    return Llama(**{**SHAPE, "output_init": "scaled", **settings}).eval()  # type: ignore[arg-type]


def tokens(rows: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_shapes_padded_head_and_model_line() -> None:
    model = llama(n_kv_head=2)
    hidden = model(tokens())
    assert hidden.shape == (2, 24, 32) and model.logits(hidden).shape == (2, 24, 128)  # 100 padded to 128
    assert model.describe() == "2 layers of width 32, vocabulary 100, 64 positions, 4 heads, 2 key/value heads"
    with pytest.raises(ValueError, match=r"exceeds model.backbone.max_seq_len=64"):
        model(tokens(length=65))


def test_parameters_are_named_as_hugging_face_llama_without_its_model_prefix() -> None:
    names = set(llama(n_layer=1, qk_norm=True, tie_head=False).state_dict())
    attention = [f"self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    mlp = [f"mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    layer = [f"layers.0.{name}" for name in [*attention, *mlp, "input_layernorm", "post_attention_layernorm"]]
    assert names == {f"{name}.weight" for name in ["embed_tokens", *layer, "norm", "lm_head"]}  # q/k_norm: Qwen3's
    assert not any("q_norm" in name or "lm_head" in name for name in llama().state_dict())


@pytest.mark.parametrize("causal", [True, False])
def test_a_causal_model_ignores_later_tokens_and_a_bidirectional_one_reads_them(causal: bool) -> None:
    model = llama(causal=causal)
    original = tokens(1)
    changed = original.clone()
    changed[0, 15:] = 4
    with torch.no_grad():
        before, after = model(original), model(changed)
    assert torch.equal(before[0, :15], after[0, :15]) is causal
    assert not torch.allclose(before[0, 15:], after[0, 15:])


@pytest.mark.parametrize("causal", [True, False])
def test_a_document_reads_as_if_it_were_alone(causal: bool) -> None:
    model = llama(causal=causal, n_kv_head=2, qk_norm=True)
    documents = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5])
    row = tokens(1)
    with torch.no_grad():
        packed = model(row, documents=documents, position_ids=document_positions(documents))
        for start, end in [(0, 7), (7, 19), (19, 24)]:
            torch.testing.assert_close(packed[:, start:end], model(row[:, start:end]), rtol=0, atol=1e-5)


def test_grouped_query_attention_equals_repeated_keys_and_values() -> None:
    """Two key/value heads for four query heads compute what four key/value heads do whose weights repeat
    each group's: the grouping only saves the copies."""
    grouped = llama(n_kv_head=2)
    repeated = llama()
    repeated.load_state_dict(
        {name: w for name, w in grouped.state_dict().items() if "k_proj" not in name and "v_proj" not in name},
        strict=False,
    )
    with torch.no_grad():
        for small, full in zip(grouped.layers, repeated.layers, strict=True):
            for name in ("k_proj", "v_proj"):
                heads = getattr(small.self_attn, name).weight.view(2, 8, 32)  # (kv head, head width, d_model)
                getattr(full.self_attn, name).weight.copy_(heads.repeat_interleave(2, dim=0).reshape(32, 32))
        torch.testing.assert_close(grouped(tokens()), repeated(tokens()), rtol=0, atol=1e-6)
    assert grouped.layers[0].self_attn.k_proj.weight.shape == (16, 32)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_groups_query_heads_as_sdpa_does() -> None:
    """The CUDA path under documents (FlexAttention with enable_gqa, here uncompiled on the CPU) pairs query
    heads with key/value heads as the CPU path (SDPA with enable_gqa) does: query head h reads key/value head
    h // (n_head / n_kv_head). Its document masks are those of tests/test_documents.py."""
    q = torch.randn(2, 4, 32, 16)
    k, v = torch.randn(2, 2, 2, 32, 16).unbind(0)
    with torch.no_grad():
        flex = flex_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(flex, multi_head_attention(q, k, v, None, causal=False), rtol=0, atol=1e-5)


def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys() -> None:
    model = llama(qk_norm=True, norm_eps=1e-12)  # an epsilon far below the squares it is added to
    assert model.layers[0].self_attn.q_norm.weight.shape == (8,)  # one head's width
    with torch.no_grad():
        before = model(tokens())
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(5)
        torch.testing.assert_close(model(tokens()), before, rtol=0, atol=1e-4)


def test_the_head_is_the_embedding_unless_untied() -> None:
    tied, untied = llama(), llama(tie_head=False)
    assert tied.head_weight is tied.embed_tokens.weight and tied.lm_head is None
    assert untied.lm_head is not None and untied.head_weight is untied.lm_head.weight
    assert untied.head_weight.shape == untied.embed_tokens.weight.shape == (128, 32)
    untied.logits(untied(tokens())).sum().backward()
    assert untied.lm_head.weight.grad is not None and untied.embed_tokens.weight.grad is not None


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"n_kv_head": 1, "qk_norm": True},
        {"tie_head": False, "mlp_width": 96, "activation": "relu2"},
        {"n_kv_head": 2, "head_dim": 16, "attention_bias": "qkv", "qk_norm": True},
        {"head_dim": 4, "attention_bias": "all"},
    ],
    ids=["plain", "grouped-qk-norm", "untied-relu2", "wide-heads-qkv-bias", "narrow-heads-all-biases"],
)
def test_the_parameters_are_counted_before_the_model_is_built(settings: dict[str, object]) -> None:
    built = llama(**settings)
    sizes = {
        "n_kv_head": built.n_kv_head,
        "mlp_width": built.layers[0].mlp.gate_proj.out_features,  # the default's, where unset
        "qk_norm": settings.get("qk_norm", False),
        "tie_head": settings.get("tie_head", True),
        "head_dim": settings.get("head_dim"),
        "attention_bias": settings.get("attention_bias", "none"),
    }
    shape = {key: SHAPE[key] for key in ("vocab_size", "d_model", "n_layer", "n_head")}
    assert parameter_count(**shape, **sizes) == sum(p.numel() for p in built.parameters())  # type: ignore[arg-type]


def test_the_default_mlp_width_is_eight_thirds_of_the_width_in_multiples_of_64() -> None:
    assert [default_mlp_width(d) for d in (32, 128, 768, 4096)] == [128, 384, 2048, 10944]
    assert llama().layers[0].mlp.up_proj.out_features == 128


def test_flops_per_token_counts_the_smaller_key_value_projections_and_full_width_attention() -> None:
    model = llama(n_kv_head=1, mlp_width=64)
    weights_per_layer = 2 * 32 * 32 + 2 * 32 * 8 + 3 * 32 * 64  # q and o, k and v of one head, the MLP
    assert model.flops_per_token(64) == 6 * 2 * weights_per_layer + 12 * 2 * 32 * 64


def test_heads_of_their_own_width_count_attention_over_n_head_head_dim_dimensions() -> None:
    model = llama(n_kv_head=1, mlp_width=64, head_dim=16)  # 4 heads of 16: 64 dimensions, twice d_model
    weights_per_layer = 2 * 32 * 64 + 2 * 32 * 16 + 3 * 32 * 64
    assert model.flops_per_token(64) == 6 * 2 * weights_per_layer + 12 * 2 * 64 * 64
    assert model(tokens()).shape == (2, 24, 32)


def test_biases_start_at_zero_and_rope_scaling_changes_only_the_slow_frequencies() -> None:
    biased = llama(attention_bias="qkv")
    attention = biased.layers[0].self_attn
    assert attention.o_proj.bias is None and not attention.q_proj.bias.any() and not attention.v_proj.bias.any()
    plain, scaled = llama(), llama(rope_scaling=LLAMA3)
    with torch.no_grad():
        assert torch.equal(plain(tokens(length=2)[:, :1]), scaled(tokens(length=2)[:, :1]))  # position 0: no turn
        assert not torch.allclose(plain(tokens()), scaled(tokens()))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"d_model": 30}, r"d_model=30 must be divisible by model.backbone.n_head=4: change either"),
        ({"d_model": 36, "n_head": 4}, r"d_model=36 / n_head=4 is odd: choose d_model and n_head with an even head"),
        ({"n_kv_head": 3}, r"n_head=4 must be divisible by model.backbone.n_kv_head=3: .* choose a divisor of n_head"),
        ({"n_kv_head": 0}, r"model.backbone.n_kv_head=0 must be at least 1"),
        ({"activation": "gelu"}, r"model.backbone.activation='gelu' must be one of silu, relu2"),
        ({"output_init": "xavier"}, r"model.backbone.output_init='xavier' must be one of zero, scaled"),
        ({"rope_theta": 0.0}, r"model.backbone.rope_theta=0.0 must be > 0"),
        ({"head_dim": 15}, r"model.backbone.head_dim=15 is odd: choose an even head_dim$"),
        ({"attention_bias": "q"}, r"model.backbone.attention_bias='q' must be one of none, qkv, all$"),
        ({"rope_scaling": {"rope_type": "yarn"}}, r"rope_scaling=\{'rope_type': 'yarn'\}: .* Llama 3's RoPE scaling"),
        ({"rope_scaling": {**LLAMA3, "beta": 1}}, r"rope_scaling has beta, which Llama 3's scaling does not read"),
        ({"rope_scaling": {**LLAMA3, "factor": 0}}, r"rope_scaling.factor=0 must be > 0: set it as the model's"),
        (
            {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8.5}},
            r"original_max_position_embeddings=8.5 must be at least 1 \(a whole number of positions\)",
        ),
        ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, r"high_freq_factor=4.0 must exceed low_freq_factor="),
    ],
)
def test_bad_settings_are_refused_naming_the_key_and_the_fix(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Llama(**{**SHAPE, **settings})  # type: ignore[arg-type]


def test_zero_output_projections_start_every_layer_as_the_identity() -> None:
    torch.manual_seed(0)
    model = Llama(**SHAPE)  # type: ignore[arg-type]
    assert all(
        not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any() for layer in model.layers
    )
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), model.norm(model.embed_tokens(tokens())))
    scaled = llama(n_layer=8)
    assert scaled.layers[0].mlp.down_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.15)
    assert scaled.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)


def test_dropout_acts_in_training_only() -> None:
    model, ids = llama(dropout=0.5).train(), tokens()
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), llama()(ids))  # the same weights (seeded), no dropout


def test_rms_norm_computes_in_float32_and_scales_after_casting_back() -> None:
    norm = llama().norm
    with torch.no_grad():
        norm.weight.fill_(1.5)
        x = torch.randn(3, 32).bfloat16()
        wide = x.float()
        expected = norm.weight * (wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + 1e-5)).bfloat16()
        assert torch.equal(norm(x), expected)


def pair_batch(rows: int = 3) -> dict[str, torch.Tensor]:
    def side(length: int, seed: int) -> torch.Tensor:
        """CLS first; the first row padded after half its length."""
        ids = tokens(rows, length, seed)
        ids[:, 0] = CLS_ID
        ids[0, length // 2 :] = PAD_ID
        return ids

    return {"query": side(12, 1), "passage": side(20, 2), "sample_id": torch.arange(rows)}


OBJECTIVES = {
    "causal_lm": lambda: CausalLM(llama(causal=True), optimizer=adamw),
    "masked_lm": lambda: MaskedLM(llama(causal=False), optimizer=adamw),
    "contrastive": lambda: Contrastive(llama(causal=False), optimizer=adamw, embed_dim=16),
    "contrastive_two_towers": lambda: Contrastive(
        llama(causal=False), optimizer=adamw, embed_dim=16, shared_towers=False
    ),
}


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_every_objective_trains_every_parameter_of_a_llama(objective: str) -> None:
    model = OBJECTIVES[objective]().train()
    blocks = {"tokens": tokens(3, 33), "sample_id": torch.arange(3)}
    batch = pair_batch() if objective.startswith("contrastive") else blocks
    loss = model.training_loss(batch)
    loss.backward()
    assert loss.isfinite()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.isfinite().all(), name
        assert parameter.grad.any() or name.endswith("logit_bias"), name  # the bias serves the sigmoid loss only


def test_a_llama_config_is_trusted_as_a_class_of_this_package() -> None:
    check_targets({"backbone": {"_target_": "pretraining.models.llama.Llama"}}, "model", [], "a checkpoint")


@pytest.mark.slow  # 20 s, most of it a process starting; the in-process runs below stay in the fast suite
def test_pretrain_runs_with_the_llama_backbone(tmp_path: Path, shard_dir: Path) -> None:
    """The command a user types: `pretrain ... model/backbone=llama`, with grouped-query attention."""
    overrides = [*TINY_RUN, "model/backbone=llama", "model.backbone.n_kv_head=1", "trainer.max_steps=4"]
    command = [sys.executable, "-m", "pretraining", *overrides, f"data.dir={shard_dir}", f"paths.log_dir={tmp_path}"]
    finished = subprocess.run([*command, "run_name=llama"], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (tmp_path / "train" / "runs" / "llama" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("experiment", ["clm_tiny", "mlm_tiny", "contrastive_tiny"])
def test_each_experiment_trains_with_the_llama_backbone(compose_train, experiment: str) -> None:
    metrics = train(compose_train("model/backbone=llama", "trainer.max_steps=4", experiment=experiment))
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])


def test_a_transformer_key_is_refused_for_a_llama_run_before_any_work(compose_train) -> None:
    with pytest.raises(
        ConfigError,
        match=r"model.backbone.positions='learned': .* is not a parameter of pretraining.models.llama.Llama",
    ):
        train(compose_train("model/backbone=llama", "+model.backbone.positions=learned"))
