"""Print what the model writes, so a run shows what it learned."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from pretraining.data.contract import training_data
from pretraining.objectives.causal_lm import CausalLM


class TextSample(Callback):
    """When training completes, print a sampled continuation of `prompt` from rank zero. Every rank samples
    (the same text): under FSDP the forward pass needs all of them."""

    def __init__(
        self, prompt: str = "def ", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50, seed: int = 0
    ) -> None:
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.temperature, self.top_k, self.seed = temperature, top_k, seed

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not isinstance(pl_module, CausalLM) or trainer.global_step < trainer.max_steps:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            text = pl_module.complete(
                training_data(trainer, "callbacks.text_sample").tokenizer,
                self.prompt,
                self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
            )
        rank_zero_info(f"\nSample at step {trainer.global_step}:\n{'-' * 60}\n{text}\n{'-' * 60}")
