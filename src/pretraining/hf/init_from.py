"""`model.init_from=DIR`: a fresh run starts from the weights of a Hugging Face GPT-2 directory, for
continued pretraining: one `pretrain-export` wrote, or one of your own that computes what the backbone
computes and reads the run's tokenizer (a stock GPT-2 does neither: `gelu_new`, and no `<pad>`, `<eos>`,
`<mask>`, `<cls>` at ids 0-3). Its sizes and tokenizer are checked against the run's before any weights
are loaded; the run's lineage records where it started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError, MissingFileError
from pretraining.files import sha256_of
from pretraining.hf.directory import LINEAGE, read_config, read_json, read_weights, weight_files
from pretraining.hf.tokenizer import check_same_tokenizer
from pretraining.hf.weights import check_gpt2_fits, from_gpt2
from pretraining.models.transformer import Transformer


def initialise_from(backbone: Transformer, given: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """Load the GPT-2 model in the directory `given` (as model.init_from names it) into `backbone`; return
    its origin record for the lineage."""
    directory, source = Path(given), f"model.init_from={given}"
    if not directory.is_dir():
        raise MissingFileError(f"{source}: no such directory; name a Hugging Face GPT-2 model directory")
    config = read_config(directory)
    if config.get("model_type") != "gpt2":
        raise ConfigError(
            f"{source} holds a {config.get('model_type')!r} model: model.init_from starts from GPT-2 models "
            "(model_type gpt2, as `pretrain-export` writes a next-token model)"
        )
    check_gpt2_fits(config, backbone, tokenizer.vocab_size, source)
    check_same_tokenizer(
        directory / "tokenizer.json",
        tokenizer,
        "the run must read text as the model was trained to: pass the "
        "tokenizer it was trained with (tokenizer=bytes, or tokenizer=bpe tokenizer.path=...)",
    )
    files = weight_files(directory)
    origin = {
        "given": given,
        "init_from": str(directory.resolve()),
        "weights_sha256": {path.name: sha256_of(path) for path in files},
        "exported_from": exported_from(directory),
    }
    weights = read_weights(files)
    backbone.load_state_dict(from_gpt2(weights, backbone, source))
    return origin


def is_origin(given: str, origin: dict[str, Any]) -> bool:
    """Whether `given` names the directory of `origin`: as it was named then, or the same place now."""
    return given == origin.get("given") or str(Path(given).resolve()) == origin["init_from"]


def describe_origin(origin: dict[str, Any] | None) -> str:
    """Where a run's first weights came from, in a line: the directory (and the checkpoint it was exported from)."""
    if not origin:
        return "random initialisation"
    exported = origin.get("exported_from")
    source = f", exported from {exported['checkpoint']} (step {exported['step']})" if exported else ""
    return f"{origin['init_from']} (model.init_from){source}"


def exported_from(directory: Path) -> dict[str, Any] | None:
    """The checkpoint a `pretrain-export` directory came from (its path, step, code and data), if it says."""
    path = directory / LINEAGE
    if not path.is_file():
        return None
    record = read_json(path)
    lineage = record.get("lineage")
    lineage = lineage if isinstance(lineage, dict) else {}
    return {
        "checkpoint": record.get("checkpoint"),
        "checkpoint_sha256": record.get("checkpoint_sha256"),
        "step": lineage.get("step"),
        "code": lineage.get("code"),
        "data_version": lineage.get("data_version"),
    }
