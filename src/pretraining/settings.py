"""The top-level keys of the entry points' configs, which `pretraining.schema` checks them against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pretraining.ranges import Range

ResumeMode = Literal["auto", "never"]
# A deliberate change a resume accepts when `resume_allow` names it (`pretraining.resume.FIT_CHECKS`).
Change = Literal["data", "tokenizer", "topology", "mixture"]


@dataclass
class TrainSettings:
    """The keys of configs/train.yaml; each group is a node (callbacks, logger: mappings of nodes) checked against
    its `_target_`."""

    data: dict[str, Any]
    tokenizer: dict[str, Any]
    model: dict[str, Any]
    trainer: dict[str, Any]
    callbacks: dict[str, dict[str, Any]] | None
    logger: dict[str, dict[str, Any]] | None
    paths: dict[str, str]
    task_name: str
    run_name: str
    tags: list[str]
    seed: int
    matmul_precision: Literal["highest", "high", "medium"]  # torch.set_float32_matmul_precision
    resume: ResumeMode
    ckpt_path: str | None
    resume_allow: list[Change]
    validate_before_training: bool
    optimized_metric: str | None
    allow_tainted: bool
    trusted_targets: list[str]
    quiet: bool


@dataclass
class EvalSettings:
    """The keys of configs/eval.yaml that evaluate.py reads."""

    paths: dict[str, str]
    callbacks: dict[str, dict[str, Any]] | None
    task_name: str
    run_name: str
    ckpt_path: str
    data_dir: str | None
    tokenizer_path: str | None
    val_size: Annotated[int, Range(ge=1)] | None
    accelerator: str
    trusted_targets: list[str]
    trust_pipe_commands: bool
    prompt: str | None
    max_new_tokens: Annotated[int, Range(ge=1)]
    temperature: Annotated[float, Range(gt=0)]
    top_k: Annotated[int, Range(ge=1)] | None
    seed: int
    quiet: bool
