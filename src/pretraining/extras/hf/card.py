"""The model card (README.md) of an export: what the model is and where it came from, for the Hub and
for whoever finds the directory later. Its facts come from the checkpoint's lineage and sidecar."""

from __future__ import annotations

from typing import Any

import yaml

from pretraining.extras.hf.llama import LLAMA_TYPES

# (library_name, pipeline_tag) by the kind of export: a next-token one's is its model_type
CARD_TAGS = {
    **{kind: ("transformers", "text-generation") for kind in ("gpt2", *LLAMA_TYPES)},
    "masked-lm": ("transformers", "fill-mask"),
    "embedding": ("sentence-transformers", "sentence-similarity"),
}


def checksum(digest: str | dict[str, str]) -> str:
    """A checkpoint file's SHA-256, or for a sharded directory where its files' are."""
    return f"SHA-256 {digest}" if isinstance(digest, str) else f"{len(digest)} files, SHA-256 each in lineage.json"


def model_card(kind: str, record: dict[str, Any], usage: str) -> str:
    """README.md for an export of `kind` from the lineage `record` (as lineage.json holds it)."""
    lineage, config = record["lineage"], record["lineage"].get("config") or {}
    library, pipeline = CARD_TAGS[kind]
    front = {"library_name": library, "pipeline_tag": pipeline, "tags": ["pretraining-template", kind]}
    code = lineage.get("code") or {}
    dirty = " (uncommitted changes)" if code.get("dirty") else ""
    facts = [
        ("objective", config.get("model", {}).get("_target_")),
        (
            "run",
            f"{config.get('task_name')}/{config.get('run_name')} (W&B run {lineage.get('wandb_run_id') or 'none'})",
        ),
        ("step", lineage.get("step")),
        ("checkpoint", f"`{record['checkpoint']}` ({checksum(record['checkpoint_sha256'])})"),
        ("code revision", f"{code.get('commit')}{dirty}"),
        ("data version", f"{lineage.get('data_version')} ({data_origin(config.get('data', {}))})"),
        (
            "tokenizer",
            f"{config.get('tokenizer', {}).get('_target_')} (fingerprint {lineage.get('tokenizer_fingerprint')})",
        ),
        ("weights from", (lineage.get("origin") or {}).get("summary", "random initialisation")),
    ]
    validation = {name: value for name, value in (record.get("validation") or {}).items() if name.startswith("val/")}
    metrics = (
        "\n".join(f"| {name} | {value:.4f} |" for name, value in sorted(validation.items()))
        if validation
        else "| (none: this step was not validated) | |"
    )
    return "\n".join(
        [
            f"---\n{yaml.safe_dump(front, sort_keys=False)}---",
            f"# {config.get('run_name')} at step {lineage.get('step')}",
            "",
            "Pretrained with the Lightning + Hydra pretraining template and exported by `pretrain-export`. "
            "`lineage.json` holds the full record, the resolved training config included.",
            "",
            "| | |\n|---|---|",
            *(f"| {name} | {value} |" for name, value in facts),
            "",
            f"## Validation at step {lineage.get('step')}",
            "",
            "| metric | value |\n|---|---|",
            metrics,
            "",
            "## Use",
            "",
            f"```python\n{usage}\n```",
            "",
        ]
    )


def data_origin(data: dict[str, Any]) -> str:
    """Where the run's data came from: its directory, or a mixture's sources with their weights."""
    sources = data.get("sources")
    if not sources:
        return f"data.dir={data.get('dir')}"
    return "data.sources: " + ", ".join(
        f"{name} {source.get('weight', 1.0):g} ({source['dir']})" for name, source in sources.items()
    )
