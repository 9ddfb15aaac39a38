"""`model.compile=true` on the CPU: each transformer block compiled by inductor with the machine's C++
compiler. A compiled model computes what the eager one does, to float rounding, and a compiled run killed
and restarted ends bitwise as the uninterrupted compiled run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import tiny_run
from pretraining.models.backbone import Backbone
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from test_resume import RESUMABLE, TEST_ENV, kill_twice_and_compare


def test_compiled_blocks_compute_what_eager_blocks_do() -> None:
    torch.manual_seed(0)
    assert_compiled_computes_what_eager_does(
        Transformer(vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, n_head=2)
    )


@pytest.mark.slow  # about 20 s of compiling (cold cache); the Transformer's layers compile in the fast suite
def test_compiled_llama_layers_compute_what_eager_layers_do() -> None:
    """Grouped-query attention and QK-norm compiled; GPT-2's init, so that every layer has gradients."""
    torch.manual_seed(0)
    settings = {"n_head": 4, "n_kv_head": 2, "qk_norm": True, "output_init": "scaled"}
    assert_compiled_computes_what_eager_does(Llama(vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, **settings))


def assert_compiled_computes_what_eager_does(backbone: Backbone) -> None:
    """Loss and gradients of a compiled model against the same model eager, on the same batch, with documents
    masked (the boolean SDPA mask path)."""
    settings = {"optimizer": torch.optim.AdamW, "document_masking": True}
    models = {compiled: CausalLM(copy.deepcopy(backbone), compile=compiled, **settings) for compiled in (False, True)}
    models[True].configure_model()
    documents = torch.arange(33).div(10, rounding_mode="floor").expand(4, 33)  # documents of 10 tokens
    batch = {"tokens": torch.randint(8, 64, (4, 33)), "doc_ids": documents}
    gradients = {}
    for compiled, model in models.items():
        model.zero_grad()
        loss = model.training_loss(batch)
        loss.backward()
        gradients[compiled] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(gradients[True][0], gradients[False][0], rtol=1e-5, atol=1e-6)
    for compiled_grad, eager_grad in zip(gradients[True][1], gradients[False][1], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # four compiled runs
def test_a_compiled_run_resumes_exactly(tmp_path: Path, small_shards: Path, monkeypatch) -> None:
    """Killed twice and restarted, a compiled run (dropout on: inductor draws its own dropout masks from the
    reseeded generator) ends bitwise as the uninterrupted one. (That compiled layers compute what eager ones
    do is the fast suite's check of their gradients, above.)"""
    kernels = tmp_path / "inductor"  # where the runs' compiled kernels go: proof that they compiled
    monkeypatch.setitem(TEST_ENV, "TORCHINDUCTOR_CACHE_DIR", str(kernels))
    overrides = [*tiny_run("clm_tiny"), *RESUMABLE, f"data.dir={small_shards}", "model.compile=true"]
    kill_twice_and_compare(tmp_path, overrides, kills=(5, 9), max_steps=12)
    assert any(path.suffix == ".py" for path in kernels.rglob("*")), "no kernel was compiled"
