"""Next-token prediction over packed blocks."""

from __future__ import annotations

import math
from typing import Any

import torch

from pretraining.data.tokenizer import EOS_ID, Tokenizer
from pretraining.errors import ConfigError
from pretraining.models.backbone import Backbone
from pretraining.objectives.base import frozen, sums, uncompiled
from pretraining.objectives.language_model import LanguageModel, Scored, input_documents


class CausalLM(LanguageModel):
    """GPT-style language model: predict token t+1 from tokens up to t. Validation reports loss, perplexity
    and bits per byte, from summed NLL, token and byte counts."""

    def __init__(self, backbone: Backbone, **settings: Any) -> None:
        """`settings`: what every language model takes (`LanguageModel`)."""
        if not backbone.causal:
            raise ConfigError("CausalLM needs a causal backbone: set model.backbone.causal=true")
        super().__init__(backbone, validation_state=sums("nll", "tokens", "bytes"), **settings)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.backbone.logits(self.backbone(tokens))

    def scored_inputs(self, batch: dict[str, torch.Tensor], validation: bool = False) -> Scored:
        """Every position is scored, in training and validation: its target is the next token."""
        tokens = batch["tokens"]
        return Scored(tokens[:, :-1], input_documents(batch), None, tokens[:, 1:])

    def validation_update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "nll": self.scored_loss(batch, "sum", validation=True),
            "tokens": torch.tensor(batch["tokens"][:, 1:].numel(), dtype=torch.float64),
            "bytes": batch["target_bytes"].sum(),
        }

    def validation_metrics(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        loss = totals["nll"] / totals["tokens"]
        return {"loss": loss, "ppl": loss.exp(), "bpb": totals["nll"] / (math.log(2) * totals["bytes"])}

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_id: int | None = EOS_ID,
    ) -> torch.Tensor:
        """Sample continuations of `prompt` (batch, length); stops early when every row ends in `eos_id` (the
        template's tokenizers' by default; None: never)."""
        tokens = prompt
        for _ in range(max_new_tokens):
            window = tokens[:, -self.backbone.max_seq_len :]
            logits = self(window)[:, -1, : self.backbone.vocab_size].float() / max(temperature, 1e-5)
            if top_k is not None:
                threshold = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            following = torch.multinomial(logits.softmax(-1), 1)
            tokens = torch.cat([tokens, following], dim=1)
            if eos_id is not None and (following == eos_id).all():
                break
        return tokens

    def complete(self, tokenizer: Tokenizer, prompt: str, max_new_tokens: int = 200, **sampling) -> str:
        """Text continuation of `prompt`, sampled in eval mode."""
        ids = torch.tensor([tokenizer.encode(prompt)], device=self.device)
        with frozen(self), uncompiled():
            return tokenizer.decode(self.generate(ids, max_new_tokens, eos_id=tokenizer.eos_id, **sampling)[0].tolist())
