"""`callbacks=[default,init_from_hf] callbacks.init_from_hf.path=DIR`: a fresh run starts from the weights of a
Hugging Face directory, for continued pretraining: GPT-2 for the `Transformer` backbone, the Llama family (Llama,
Qwen2, Qwen3, Mistral) for the `Llama` one, with the backbone options that compute what the stock model computes.
Its config.json and tokenizer are checked against the run's before any weights are read; the weights then stream
in tensor by tensor (`pretraining.extras.hf.loading`, which says what each FSDP2 rank reads). The run's lineage
records where it started (`origin`, with the directory's config.json). The core's `callbacks.init_from`
(`pretraining.init_from`) starts a run from one of the template's own checkpoints instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

from pretraining.checkpoint import checkpoint_digest
from pretraining.data.contract import training_data
from pretraining.data.tokenizer import Tokenizer
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.hf.directory import LINEAGE, StoredTensors, read_config, read_json, weight_files
from pretraining.extras.hf.llama import LLAMA_TYPES, check_llama_fits, load_llama
from pretraining.extras.hf.loading import Tensors
from pretraining.extras.hf.tokenizer import check_same_tokenizer
from pretraining.extras.hf.weights import GPT2_VOCAB_SIZE, check_gpt2_fits, check_standard, load_gpt2
from pretraining.files import sha256_of
from pretraining.init_from import InitFrom
from pretraining.models.backbone import Backbone, padded_vocabulary
from pretraining.models.llama import Llama
from pretraining.models.parametrization import KEY as RULES
from pretraining.models.transformer import Transformer
from pretraining.objectives.base import PretrainingObjective

try:  # the registry extra, where this fork keeps it: a model exported from a tainted checkpoint is refused
    from pretraining.extras.registry import versions as registry
except ModuleNotFoundError:
    registry = None  # type: ignore[assignment]

KEY = "callbacks.init_from_hf"


class InitFromHF(InitFrom):
    """Load the model directory `path` into a fresh run's backbone at set-up, before any validation or step;
    a resumed run keeps its checkpoint's weights, and must name the directory it started from. A directory
    exported from a checkpoint that the registry in `registry_dir` marks tainted is refused unless
    `allow_tainted`."""

    key = KEY

    def __init__(self, path: str, registry_dir: str | None = None, allow_tainted: bool = False) -> None:
        super().__init__(path)
        self.registry_dir, self.allow_tainted = registry_dir, allow_tainted

    def start(self, trainer: Trainer, objective: PretrainingObjective) -> dict[str, Any]:
        tokenizer = training_data(trainer, KEY).tokenizer
        origin = initialise_from(objective.backbone, self.path, tokenizer)
        exported = (origin["exported_from"] or {}).get("checkpoint_sha256")
        if exported and registry is not None and self.registry_dir is not None and not self.allow_tainted:
            what = f"{KEY}.path={self.path} (exported from {origin['exported_from']['checkpoint']})"
            registry.check_not_tainted(
                registry.Registry(self.registry_dir), checkpoint_digest(exported), what, "a start", "allow_tainted=true"
            )
        return origin


# What each backbone starts from: the model types it reads, in words, and the config that chooses it.
STARTS = [
    (Transformer, ("gpt2",), "GPT-2 models (model_type gpt2)", "model/backbone=transformer"),
    (Llama, LLAMA_TYPES, "Llama models (model_type llama, qwen2, qwen3 or mistral)", "model/backbone=llama"),
]
Loader = Callable[[Tensors], None]  # loads the tensors into the backbone it was made for


def initialise_from(backbone: Backbone, given: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """Load the model in the directory `given` (as `callbacks.init_from_hf.path` names it) into `backbone`: a
    GPT-2 model into a `Transformer`, a Llama-family one into a `Llama`; return its origin record for the lineage
    (with its config.json, from which an export writes the same architecture)."""
    if not isinstance(backbone, Transformer | Llama):
        raise ConfigError(
            f"{KEY} loads GPT-2 or Llama weights into the template's backbones, and this run's is "
            f"{type(backbone).__name__}: train it from scratch (drop {KEY}), or choose model/backbone=transformer "
            "or model/backbone=llama"
        )
    directory, source = Path(given), f"{KEY}.path={given}"
    if not directory.is_dir():
        raise MissingFileError(f"{source}: no such directory; name a Hugging Face model directory")
    config = read_config(directory)
    load = checked_loader(config, backbone, tokenizer.vocab_size, source)
    check_same_table(config, backbone, source)
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
        "config": config,
    }
    origin["summary"] = describe_origin(origin)  # what `pretrain-info` shows
    load(StoredTensors(files))
    return origin


def checked_loader(config: dict[str, Any], backbone: Transformer | Llama, vocab_size: int, source: str) -> Loader:
    """What loads the weights of the model `config` describes into `backbone` (`StoredTensors`, or a state dict),
    once the config is checked to fit it; a model of another kind than the backbone's is refused, naming both."""
    kind = config.get("model_type")
    if isinstance(backbone, Llama) and kind in LLAMA_TYPES:
        check_standard(backbone, f"and {source} holds a standard one: start from it with {RULES}=standard")
        check_llama_fits(config, backbone, vocab_size, source)
        return lambda tensors: load_llama(tensors, backbone, source)
    if isinstance(backbone, Transformer) and kind == "gpt2":
        check_standard(backbone, f"and {source} holds a standard one: start from it with {RULES}=standard")
        check_gpt2_fits(config, backbone, vocab_size, source)
        return lambda tensors: load_gpt2(tensors, backbone, source)
    (words,) = [words for kinds, _, words, _ in STARTS if isinstance(backbone, kinds)]
    other = [choice for kinds, types, _, choice in STARTS if kind in types]
    hint = f"; a {kind} model starts a run with {other[0]}" if other else ""
    raise ConfigError(
        f"{source} holds a {kind!r} model: {KEY} starts from {words} into this run's "
        f"{type(backbone).__name__} backbone{hint}"
    )


def check_same_table(config: dict[str, Any], backbone: Transformer | Llama, source: str) -> None:
    """Refuse a model whose vocabulary table has other rows than the backbone's: rows only the backbone has would
    join the softmax untrained, and rows only the file has would leave it, so the first step's loss would not be
    the model's."""
    rows = config.get("vocab_size", GPT2_VOCAB_SIZE if config.get("model_type") == "gpt2" else None)
    table = len(backbone.head_weight)
    if rows == table:
        return
    if rows == backbone.vocab_size:
        fix = "pass model.backbone.pad_vocabulary=false (a table of exactly vocab_size rows)"
    elif rows == padded_vocabulary(backbone.vocab_size):
        fix = "pass model.backbone.pad_vocabulary=true (its padded table)"
    else:
        fix = "use the model's own tokenizer (tokenizer=hf tokenizer.path=<its directory>): its ids are the rows"
    raise ConfigError(
        f"{source} has vocab_size={rows!r}, and this run's table has {table} rows for its tokenizer's "
        f"{backbone.vocab_size} ids: {fix}"
    )


def describe_origin(origin: dict[str, Any]) -> str:
    """Where a run's first weights came from, in a line: the directory (and the checkpoint it was exported from)."""
    exported = origin.get("exported_from")
    source = f", exported from {exported['checkpoint']} (step {exported['step']})" if exported else ""
    return f"{origin['init_from']} ({KEY}){source}"


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
