"""Export a checkpoint as a Hugging Face model directory: `pretrain-export CKPT OUT` (or `make export`).

`transformers` loads the directory without this package installed:
- a next-token model as GPT-2 (`GPT2LMHeadModel`, `AutoModelForCausalLM`), or, with the Llama backbone, as
  `LlamaForCausalLM` (`Qwen3ForCausalLM` with QK-norm, `Qwen2ForCausalLM` with q/k/v biases); one that started
  from a model directory as that directory's architecture, with its tokenizer's own files (`tokenizer=hf`);
- a masked-LM model as `AutoModelForMaskedLM`, and a contrastive one as `AutoModel` and as a
  `sentence-transformers` model, both with their modelling code written beside the weights
  (`trust_remote_code=True`);
- the template's tokenizer as a `PreTrainedTokenizerFast` that gives the template's ids (an encoder's loads with
  `PreTrainedTokenizerFast.from_pretrained`: `AutoTokenizer` reads config.json first, whose `auto_map` needs
  the modelling code, so without `trust_remote_code=True` it asks to run it);
- a model card (README.md) and `lineage.json`: config, code revision, data version, step, validation.

The checkpoint (a file, or a sharded FSDP2 directory, gathered in this one process) must verify against
its sidecar and, where the registry extra is installed, must not be tainted in the registry (unless
`--allow-tainted`); nothing in it can run code. OUT is written whole or not at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pretraining.callbacks.lineage import code_revision
from pretraining.checkpoint import sidecar_checksums, sidecar_digest, verify
from pretraining.config import PROJECT_ROOT
from pretraining.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from pretraining.errors import ConfigError
from pretraining.extras.hf import AUTO_MAP, MODELLING_CODE
from pretraining.extras.hf.card import model_card
from pretraining.extras.hf.directory import (
    CONFIG,
    LINEAGE,
    SAFETENSORS,
    Content,
    as_json,
    check_destination,
    sharded_weights,
    weights_file,
    write_directory,
)
from pretraining.extras.hf.llama import LLAMA_TYPES, llama_config, to_llama
from pretraining.extras.hf.model_tokenizer import ModelTokenizer
from pretraining.extras.hf.tokenizer import CLS, EOS, MASK, PAD, tokenizer_files
from pretraining.extras.hf.weights import check_standard, encoder_config, gpt2_config, to_encoder, to_gpt2
from pretraining.models.backbone import Backbone
from pretraining.models.llama import Llama
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import PretrainingObjective
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.stored import load_checkpoint, stored_model

try:  # the registry extra, where this fork keeps it: a tainted checkpoint is not exported
    from pretraining.extras.registry import versions as registry
except ModuleNotFoundError:
    registry = None  # type: ignore[assignment]

Files = dict[str, Content]


def export(
    checkpoint_path: Path,
    out: Path,
    tokenizer_path: str | None = None,
    trusted: list[str] | None = None,
    registry_dir: Path | None = None,
    allow_tainted: bool = False,
) -> str:
    """Write the Hugging Face directory `out` for the checkpoint; return the kind of export. A checkpoint
    that the registry in `registry_dir` marks tainted is refused unless `allow_tainted`."""
    check_destination(out)
    sidecar = verify(checkpoint_path)  # a checkpoint without a verified sidecar is not exported
    if registry is not None and registry_dir is not None and not allow_tainted:
        ledger = registry.Registry(registry_dir)
        registry.check_not_tainted(
            ledger, sidecar_digest(sidecar), str(checkpoint_path), "an export", "--allow-tainted"
        )
    checkpoint = load_checkpoint(checkpoint_path)
    model, _, examples = stored_model(
        checkpoint,
        str(checkpoint_path),
        tokenizer_path,
        trusted or [],
        "--tokenizer PATH",
        "--trusted-targets {module}",
    )
    origin = (checkpoint["lineage"].get("origin") or {}).get("config")
    kind, files = model_files(model.eval(), examples.tokenizer, examples.lengths, origin)
    record = lineage_record(checkpoint_path, sidecar, checkpoint["lineage"], kind)
    files[LINEAGE] = as_json(record)
    files["README.md"] = model_card(kind, record, usage(kind, out)).encode()
    write_directory(out, files)
    return kind


def model_files(
    model: PretrainingObjective, tokenizer: Tokenizer, lengths: dict[str, int], origin: dict[str, Any] | None = None
) -> tuple[str, Files]:
    """(kind, files) of the model and its tokenizer, by backbone and objective. A next-token run that started
    from a model directory whose config.json is `origin` goes out as that architecture (`continued_config`)."""
    backbone = model.backbone
    if not isinstance(backbone, Llama | Transformer):
        raise ConfigError(
            f"{type(backbone).__name__} has no Hugging Face export: pretrain-export writes the template's own "
            "backbones (pretraining.models.transformer.Transformer, pretraining.models.llama.Llama)"
        )
    check_standard(
        backbone, "whose multipliers the Hugging Face architectures lack: pretrain-export writes standard ones"
    )
    if not isinstance(model, Contrastive):  # an embedding model's export has no language-model head
        check_linear_head(backbone)
    if isinstance(backbone, Llama):
        return llama_files(model, backbone, tokenizer, origin)
    if isinstance(model, CausalLM):
        config = continued_config(origin) if origin else {**gpt2_config(backbone), **own_ids(tokenizer)}
        return "gpt2", next_token_files(config, to_gpt2(backbone), backbone, tokenizer)
    if isinstance(model, MaskedLM):
        return "masked-lm", masked_lm_files(backbone, tokenizer)
    if isinstance(model, Contrastive):
        return "embedding", embedding_files(model, backbone, tokenizer, lengths["passage_len"])
    raise ConfigError(
        f"{type(model).__name__} has no Hugging Face export: pretrain-export knows CausalLM, MaskedLM and Contrastive"
    )


def llama_files(
    model: PretrainingObjective, backbone: Llama, tokenizer: Tokenizer, origin: dict[str, Any] | None
) -> tuple[str, Files]:
    """A next-token Llama as Hugging Face's Llama (Qwen3 with QK-norm). A bidirectional one has no stock
    architecture in `transformers`, and the modelling code written beside encoder exports is the Transformer's."""
    if not isinstance(model, CausalLM):
        raise ConfigError(
            f"a {type(model).__name__} Llama is bidirectional, and transformers has no Llama encoder to load it "
            "without custom code: train the encoder with model/backbone=transformer to export it"
        )
    config = continued_config(origin) if origin else {**llama_config(backbone), **own_ids(tokenizer)}
    return config["model_type"], next_token_files(config, to_llama(backbone), backbone, tokenizer)


def continued_config(origin: dict[str, Any]) -> dict[str, Any]:
    """config.json of a model continued from the directory whose config.json is `origin`: the same, key for
    key (`callbacks.init_from_hf` checked that the backbone computes what it says), but for the weights' type."""
    config = {key: value for key, value in origin.items() if key != "torch_dtype"}  # transformers 4's name
    return {**config, "dtype": "float32"}  # as the weights are written


def own_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The special ids config.json names where they are a model's own (`tokenizer=hf`), not the template's."""
    if not isinstance(tokenizer, ModelTokenizer):
        return {}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": None}


def next_token_files(
    config: dict[str, Any], weights: dict[str, torch.Tensor], backbone: Backbone, tokenizer: Tokenizer
) -> Files:
    """A next-token model in an architecture `transformers` loads as it is (no code of ours): its config,
    weights, generation settings and tokenizer. A model's own tokenizer (`tokenizer=hf`) goes out as its files
    were, with the generation settings beside them. The tables have config.json's rows already (a continued run's
    backbone was refused unless they matched: `init_from.check_same_table`)."""
    if isinstance(tokenizer, ModelTokenizer):  # its directory's generation_config.json, where it had one
        generation = {key: config.get(key) for key in ("bos_token_id", "eos_token_id")}
        own = {"generation_config.json": as_json(generation), **tokenizer.files}
    else:
        special = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}
        own = {
            "generation_config.json": as_json(generation_config(backbone)),
            **tokenizer_files(tokenizer, special, backbone.max_seq_len),
        }
    return {CONFIG: as_json(config), **sharded_weights(weights), **own}


def masked_lm_files(backbone: Transformer, tokenizer: Tokenizer) -> Files:
    """The encoder with its masked-LM head, in the modelling code written beside it; `<mask>` in a text
    is the mask token, as fill-mask needs."""
    config = {**encoder_config(backbone), "architectures": ["PretrainingForMaskedLM"], "auto_map": AUTO_MAP}
    weights = {f"model.{name}": tensor for name, tensor in to_encoder(backbone).items()}  # base_model_prefix
    return {
        CONFIG: as_json(config),
        **sharded_weights(weights),
        MODELLING_CODE.name: MODELLING_CODE.read_bytes(),
        **tokenizer_files(tokenizer, ENCODER_TOKENS, backbone.max_seq_len, marks_in_text=True),
    }


def embedding_files(model: Contrastive, backbone: Transformer, tokenizer: Tokenizer, passage_len: int) -> Files:
    """The encoder in the modelling code written beside it, as `AutoModel` and as a sentence-transformers
    model that embeds every text as the template embeds passages (CLS first, `passage_len` tokens)."""
    check_one_tower(model)
    config = {**encoder_config(backbone), "architectures": ["PretrainingModel"], "auto_map": AUTO_MAP}
    return {
        CONFIG: as_json(config),
        **sharded_weights(to_encoder(backbone)),
        MODELLING_CODE.name: MODELLING_CODE.read_bytes(),
        **tokenizer_files(tokenizer, ENCODER_TOKENS, passage_len, cls_first=True),
        **sentence_transformer_files(model, passage_len),
    }


ENCODER_TOKENS = {"eos_token": EOS, "pad_token": PAD, "mask_token": MASK, "cls_token": CLS}


def generation_config(backbone: Backbone) -> dict[str, Any]:
    """The padded ids never occur in data: generation leaves them out, as the template's sampler does."""
    return {
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "suppress_tokens": list(range(backbone.vocab_size, len(backbone.head_weight))),
    }


def check_linear_head(backbone: Backbone) -> None:
    """The architectures written here end in a plain linear head: a backbone whose `logits` does more (a soft
    cap, a scale) would load with other logits than it was trained and validated with."""
    if type(backbone).logits is not Backbone.logits:
        raise ConfigError(
            f"{type(backbone).__name__} overrides its head (`logits`), and the Hugging Face models pretrain-export "
            "writes end in the plain projection by `head_weight`: export a backbone that keeps the default head"
        )


def check_one_tower(model: Contrastive) -> None:
    if model.passage_backbone is not None:
        raise ConfigError(
            "this contrastive model has a tower per side (model.shared_towers=false); pretrain-export writes "
            "one encoder, so it exports only models trained with shared towers"
        )


def sentence_transformer_files(model: Contrastive, max_length: int) -> Files:
    """The sentence-transformers modules after the backbone: pooling, the projection, L2 normalisation."""
    width, projection = model.backbone.d_model, model.query_head.weight.detach().float().contiguous()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {"word_embedding_dimension": width, "pooling_mode": "mean" if model.pooling == "mean" else "cls"}
    dense = {
        "in_features": width,
        "out_features": len(projection),
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    return {
        "modules.json": as_json(modules),
        "sentence_bert_config.json": as_json({"max_seq_length": max_length, "do_lower_case": False}),
        "config_sentence_transformers.json": as_json({"similarity_fn_name": "cosine"}),
        "1_Pooling/config.json": as_json(pooling),
        "2_Dense/config.json": as_json(dense),
        f"2_Dense/{SAFETENSORS}": weights_file({"linear.weight": projection}),
    }


def lineage_record(path: Path, sidecar: dict[str, Any], lineage: dict[str, Any], kind: str) -> dict[str, Any]:
    """lineage.json: the checkpoint (path, checksum), its lineage and validation, and this export."""
    return {
        "checkpoint": str(path.resolve()),
        "checkpoint_sha256": sidecar_checksums(sidecar),
        "validation": sidecar.get("validation"),
        "lineage": lineage,
        "export": {"kind": kind, "code": code_revision(PROJECT_ROOT), "torch": torch.__version__},
    }


def usage(kind: str, out: Path) -> str:
    """How to load an export of `kind` at `out` (as the command named it)."""
    return USAGE[kind].format(out=repr(str(out)))


NEXT_TOKEN_USAGE = """from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({out})
model = AutoModelForCausalLM.from_pretrained({out})
ids = model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=40, do_sample=False)
print(tokenizer.decode(ids[0]))"""
USAGE = {
    **{kind: NEXT_TOKEN_USAGE for kind in ("gpt2", *LLAMA_TYPES)},  # a next-token export's kind: its model_type
    "masked-lm": """from transformers import AutoModelForMaskedLM, PreTrainedTokenizerFast
tokenizer = PreTrainedTokenizerFast.from_pretrained({out})  # a plain tokenizer: no code of the directory runs
model = AutoModelForMaskedLM.from_pretrained({out}, trust_remote_code=True)
inputs = tokenizer("def add(a, b): return a <mask> b", return_tensors="pt")
guess = model(**inputs).logits.argmax(-1)[inputs.input_ids == tokenizer.mask_token_id]
print(tokenizer.decode(guess))""",
    "embedding": """from sentence_transformers import SentenceTransformer
model = SentenceTransformer({out}, trust_remote_code=True)
embeddings = model.encode(["Return the sum of a and b.", "def add(a, b): return a + b"])""",
}
