"""What produced a checkpoint: `pretrain-info CKPT` (or `make info CKPT=...`).

Prints the checkpoint's lineage (step, code revision, data version, tokenizer, data topology, W&B
run, and what the extras added: the weights a run started from, a distillation's teacher) and its
ancestry: the checkpoint each run continued from, back to the first start. `--config` adds the full
resolved config it was trained with, `--json` prints everything as JSON. The
checkpoint is verified against its sidecar first; tensors are not read (memory-mapped, or, for a
sharded directory, only its `meta.pt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pretraining.checkpoint import CheckpointError, read_lineage, verify

# The lineage keys `Lineage` writes; any other was added by a callback or the objective (an extra's).
OWN_KEYS = {
    "format",
    "config",
    "code",
    "data_version",
    "tokenizer_fingerprint",
    "parent",
    "step",
    "topology",
    "sources",
    "mixture",
    "mixture_phases",
    "parametrization",
}


def ancestry(path: Path) -> list[dict[str, Any]]:
    """`path` and the checkpoints its run continued from, newest first: the path, step, whether it
    verifies against its sidecar, its lineage (None where the file is gone) and the validation metrics its
    sidecar records (None where it records none)."""
    chain: list[dict[str, Any]] = []
    seen: set[Path] = set()
    current: Path | None = path
    while current is not None and current.resolve() not in seen:
        seen.add(current.resolve())
        entry: dict[str, Any] = {"path": str(current), "lineage": None, "verified": None, "validation": None}
        if current.exists() or current == path:  # the checkpoint asked about must exist
            entry["lineage"] = read_lineage(current)
            try:
                entry["validation"] = verify(current).get("validation")
                entry["verified"] = "ok"
            except CheckpointError as error:
                entry["verified"] = str(error)
        chain.append(entry)
        parent = entry["lineage"] and entry["lineage"].get("parent")
        current = Path(parent) if parent else None
    return chain


def describe(chain: list[dict[str, Any]]) -> str:
    """The lineage of the newest checkpoint of `chain`, and its ancestry, as aligned lines."""
    newest = chain[0]
    lineage = newest["lineage"]
    code = lineage.get("code") or {}
    config = lineage.get("config") or {}
    dirty = {True: " (uncommitted changes)", False: "", None: " (not a git checkout)"}[code.get("dirty")]
    rows = [
        ("checkpoint", newest["path"]),
        ("verified", newest["verified"]),
        ("step", lineage.get("step")),
        ("validation", validation_summary(newest["validation"])),
        ("run", f"{config.get('task_name')}/{config.get('run_name')} (W&B run {lineage.get('wandb_run_id')})"),
        ("code", f"{code.get('commit')}{dirty}"),
        ("model", f"{config.get('model', {}).get('_target_')}{rules_summary(lineage)}"),
        ("data", f"version {lineage.get('data_version')} from {data_origin(lineage, config)}"),
        *mixture_rows(lineage),
        ("tokenizer", f"fingerprint {lineage.get('tokenizer_fingerprint')}"),
        ("topology", ", ".join(f"{key} {value}" for key, value in (lineage.get("topology") or {}).items())),
    ]
    added = {key: value for key, value in lineage.items() if key not in OWN_KEYS | {"wandb_run_id"} and value}
    rows += [(key, value.get("summary", value) if isinstance(value, dict) else value) for key, value in added.items()]
    ancestors = [
        f"{a['path']} (no longer exists)"
        if a["lineage"] is None
        else f"{a['path']} (step {a['lineage'].get('step')}, verified: {a['verified']})"
        for a in chain[1:]
    ]
    labels = ["continued from"] + [""] * len(ancestors)
    rows += list(zip(labels, ancestors or ["nothing: a first start"], strict=False))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def rules_summary(lineage: dict[str, Any]) -> str:
    """The backbone's parametrization, where it is not standard (`pretraining.models.parametrization`)."""
    rules = lineage.get("parametrization") or {}
    return f", {rules['summary']}" if rules.get("name", "standard") != "standard" else ""


def validation_summary(validation: Any) -> str:
    """The validation metrics (`val/...`) of the values a sidecar records at its validation, on one line."""
    metrics = sorted(validation.items()) if isinstance(validation, dict) else []
    metrics = [(name, value) for name, value in metrics if str(name).startswith("val/")]
    if not metrics:
        return "none recorded (the step was not validated, or its validation did not finish)"
    return ", ".join(
        f"{name} {value:.4g}" if isinstance(value, int | float) else f"{name} {value}" for name, value in metrics
    )


def data_origin(lineage: dict[str, Any], config: dict[str, Any]) -> str:
    """Where the data came from: a mixture (its sources follow), or the directory of the run's one source
    (`data.dir`, or the one entry of `data.sources`)."""
    if lineage.get("mixture"):
        return "a mixture of"
    sources = list((lineage.get("sources") or {}).values())
    return str(sources[0].get("dir") if len(sources) == 1 else config.get("data", {}).get("dir"))


def mixture_rows(lineage: dict[str, Any]) -> list[tuple[str, str]]:
    """A mixture's sources (directory, version, weight, cap) and its phases, as rows: the phases also for a run
    on one source that was a mixture before a resume."""
    mixture = lineage.get("mixture") or {}
    sources = lineage.get("sources") or {}
    rows = []
    for name, settings in mixture.items():
        where = sources.get(name, {})
        cap = (
            f", at most {settings['max_epochs']} epochs then {settings['exhausted']}" if settings["max_epochs"] else ""
        )
        rows.append(
            (f"  {name}", f"weight {settings['weight']:g}{cap}: version {where.get('version')} from {where.get('dir')}")
        )
    for phase in lineage.get("mixture_phases") or []:
        weights = ", ".join(f"{name} {weight:g}" for name, weight in phase["weights"].items())
        rows.append(("  phase", f"from step {phase['step']}: {weights}"))
    return rows


def print_info(checkpoint: Path, config: bool = False, as_json: bool = False) -> None:
    """Print the lineage and ancestry of `checkpoint` (`--json`: as JSON), and with `config` its resolved config;
    then raise `CheckpointError` if it does not verify (a missing, unreadable or mismatched sidecar), so that
    a script reading the output learns it from the exit status."""
    chain = ancestry(checkpoint)
    if as_json:
        print(json.dumps(chain, indent=2, default=str))
    else:
        print(describe(chain))
        if config:
            print("\nconfig:\n" + OmegaConf.to_yaml(OmegaConf.create(chain[0]["lineage"].get("config") or {})))
    if chain[0]["verified"] != "ok":
        raise CheckpointError(chain[0]["verified"])
