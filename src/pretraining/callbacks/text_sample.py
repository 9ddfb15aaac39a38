"""Print what the model writes, so a run shows what it learned."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from pretraining.data.contract import training_data
from pretraining.data.tokenizer import Tokenizer
from pretraining.objectives.causal_lm import CausalLM

NO_SAMPLE = "no sample: the model's logits are not finite (NaN or infinite weights, or a setting that makes them)"


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
            text = sample_text(
                pl_module,
                training_data(trainer, "callbacks.text_sample").tokenizer,
                self.prompt,
                self.max_new_tokens,
                temperature=self.temperature,
                top_k=self.top_k,
            )
        rank_zero_info(
            f"\nSample at step {trainer.global_step}:\n{'-' * 60}\n{NO_SAMPLE if text is None else text}\n{'-' * 60}"
        )


def sample_text(model: CausalLM, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, **sampling: Any) -> str | None:
    """`model.complete(...)`, or None where the model's logits turn non-finite on the way (a NaN run or checkpoint,
    or a setting that makes NaN): nothing can be drawn from them."""

    def stop_if_nonfinite(module: nn.Module, inputs: Any, logits: torch.Tensor) -> None:
        if not logits[..., : model.backbone.vocab_size].isfinite().all():
            raise NonFiniteLogits

    hook = model.register_forward_hook(stop_if_nonfinite)  # generation calls the model once a token
    try:
        return model.complete(tokenizer, prompt, max_new_tokens, **sampling)
    except NonFiniteLogits:
        return None
    finally:
        hook.remove()


class NonFiniteLogits(Exception):
    """The model's logits held a NaN or an infinity while sampling (caught by `sample_text`)."""
