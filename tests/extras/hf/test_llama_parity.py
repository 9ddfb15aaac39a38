"""The Llama backbone against Hugging Face's own: its weights load by name alone (the `model.` prefix
added) into `LlamaForCausalLM`, or `Qwen3ForCausalLM` with QK-norm, and give the same logits. What a native
export of the backbone rests on: no renaming, no re-layout of the rotary halves, RMSNorm computed alike.
Until that export exists, the GPT-2 routes refuse a Llama backbone, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from pretraining.data.tokenizer import ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.extras.hf.export import model_files
from pretraining.extras.hf.init_from import initialise_from
from pretraining.models import Llama
from pretraining.objectives.causal_lm import CausalLM

SHAPE = {"vocab_size": 100, "max_seq_len": 64, "d_model": 64, "n_layer": 2, "n_head": 4}


def hugging_face_twin(backbone: Llama) -> PreTrainedModel:
    """Hugging Face's model of `backbone`'s shape, holding its weights under its names plus `model.`."""
    sizes = {
        "vocab_size": backbone.embed_tokens.num_embeddings,  # the padded rows: an export would drop them
        "hidden_size": backbone.d_model,
        "intermediate_size": backbone.mlp_width,
        "num_hidden_layers": len(backbone.layers),
        "num_attention_heads": backbone.n_head,
        "num_key_value_heads": backbone.n_kv_head,
        "head_dim": backbone.head_width,
        "hidden_act": backbone.activation,
        "max_position_embeddings": backbone.max_seq_len,
        "rms_norm_eps": backbone.norm_eps,
        "rope_theta": backbone.rope_theta,
        "tie_word_embeddings": backbone.lm_head is None,
    }
    model = Qwen3ForCausalLM(Qwen3Config(**sizes)) if backbone.qk_norm else LlamaForCausalLM(LlamaConfig(**sizes))
    weights = {name if name.startswith("lm_head") else f"model.{name}": w for name, w in backbone.state_dict().items()}
    weights.setdefault("lm_head.weight", backbone.head_weight)
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "settings",
    [
        {"n_kv_head": 2},
        {"tie_head": False, "activation": "relu2", "rope_theta": 500000.0},
        {"n_kv_head": 1, "qk_norm": True, "norm_eps": 1e-6},
    ],
    ids=["llama-grouped", "llama-untied-relu2", "qwen3-qk-norm"],
)
def test_the_logits_are_hugging_faces(settings: dict[str, object]) -> None:
    torch.manual_seed(0)
    backbone = Llama(**SHAPE, **settings, output_init="scaled").eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for parameter in backbone.parameters():
            if parameter.dim() == 1:
                parameter.normal_(1.0, 0.1)  # norms away from one: their weight must be applied where HF does
        tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40))
        ours = backbone.logits(backbone(tokens))
        theirs = hugging_face_twin(backbone)(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_gpt2_routes_refuse_a_llama_backbone_naming_the_fix(tmp_path: Path) -> None:
    backbone = Llama(**SHAPE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Llama has no Hugging Face export"):
        model_files(CausalLM(backbone, optimizer=torch.optim.AdamW), ByteTokenizer(), {})
    with pytest.raises(ConfigError, match=r"this run's is Llama: train it from scratch .* or choose model/backbone="):
        initialise_from(backbone, str(tmp_path), ByteTokenizer())
