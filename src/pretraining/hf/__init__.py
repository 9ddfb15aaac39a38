"""Models out to Hugging Face and in from it: the backbone's weights in GPT-2's layout and in the
template's own modelling code (`modeling_pretraining.py`, written into exports), the tokenizer as a
`tokenizer.json`, atomic model directories, model cards, and `model.init_from`. `pretrain-export`
(`pretraining.export`) puts them together."""

from pathlib import Path

# Copied into exports, never imported by this package: it needs `transformers`, which exporting does not.
MODELLING_CODE = Path(__file__).with_name("modeling_pretraining.py")
# config.json's pointers from the Auto classes to that code's classes.
AUTO_MAP = {
    "AutoConfig": "modeling_pretraining.PretrainingConfig",
    "AutoModel": "modeling_pretraining.PretrainingModel",
    "AutoModelForMaskedLM": "modeling_pretraining.PretrainingForMaskedLM",
}
