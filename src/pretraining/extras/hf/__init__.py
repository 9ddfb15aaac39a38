"""Hugging Face formats (an extra): models out (`pretrain-export`, `export.py`) and in (`init_from.py`, the
`callbacks.init_from_hf` of a fresh run): the backbone's weights in GPT-2's layout, in Llama's (`llama.py`) and
in the template's own modelling code (`modeling_pretraining.py`, written into exports), the tokenizer as a
`tokenizer.json`, atomic model directories and model cards. Delete this folder and
`configs/callbacks/init_from_hf.yaml` to drop it."""

from pathlib import Path

# Copied into exports, never imported by this package: it needs `transformers`, which exporting does not.
MODELLING_CODE = Path(__file__).with_name("modeling_pretraining.py")
# config.json's pointers from the Auto classes to that code's classes.
AUTO_MAP = {
    "AutoConfig": "modeling_pretraining.PretrainingConfig",
    "AutoModel": "modeling_pretraining.PretrainingModel",
    "AutoModelForMaskedLM": "modeling_pretraining.PretrainingForMaskedLM",
}
