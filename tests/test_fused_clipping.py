"""Gradient clipping with a fused optimizer under bf16-mixed: Lightning's MixedPrecision refuses any optimizer
that can unscale gradients itself (fused AdamW, the default on CUDA), though bf16 has no loss scale. Fused AdamW
runs on the CPU too (torch >= 2.4), so the GPU default is checked here."""

from __future__ import annotations

from functools import partial

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM

CLIP = 1e-3  # far under the gradient norm of an untrained model, so that clipping always acts


class Batches:
    """A few fixed batches (a plain list would be read by Lightning as a list of dataloaders)."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class GradNorm(Callback):
    """The global gradient norm the optimizer stepped with (gradients stay until the next zero_grad)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: object) -> None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())


def test_bf16_mixed_clips_with_fused_adamw(tmp_path) -> None:
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=64, max_seq_len=16, d_model=32, n_layer=1, n_head=2)
    model = CausalLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-3, fused=True), warmup_steps=1)
    batches = [{"tokens": torch.randint(8, 64, (4, 17)), "sample_id": torch.arange(4)} for _ in range(3)]
    norms = GradNorm()
    trainer = Trainer(
        accelerator="cpu",
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[norms],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, train_dataloaders=Batches(batches))
    assert trainer.global_step == 3
    assert all(norm <= CLIP * 1.01 for norm in norms.norms), norms.norms
