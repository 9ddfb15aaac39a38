"""The in-loop score is lm_eval's own: a tiny next-token checkpoint scored by `HarnessTask` and, exported, by
`lm_eval.simple_evaluate` with `HFLM` gets the same accuracy and the same log-likelihood for every choice, with
the byte tokenizer and with a BPE (whose context/continuation split is not at a byte boundary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from evals.test_harness import write_task
from hydra import compose, initialize_config_dir
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from conftest import tiny_run
from pretraining.config import CONFIG_DIR
from pretraining.extras.evals.harness import HarnessTask
from pretraining.stored import load_checkpoint, stored_model
from pretraining.train import train

# Trailing spaces (moved to the continuation), an empty context (the end-of-text token before it) and a context
# longer than the model's (left-truncated).
DOCUMENTS = [
    {"context": "def add(a, b):\n    return a", "choices": ["+ b", "- b", "* b", "/ b"], "label": 0},
    {"context": "import ", "choices": ["os", "sys", "json", "re"], "label": 2},
    {"context": "", "choices": ["import os", "import sys", "from . import x"], "label": 1},
    {"context": "for i in range(10):\n   ", "choices": ["print(i)", "pass", "yield i"], "label": 0},
    {"context": "    " + "x = x + 1\n    " * 40 + "return", "choices": ["x", "None", "self.value"], "label": 0},
    {"context": "class Parser(object):\n    def __init__(self", "choices": ["):", ", text):", ", *args):"], "label": 1},
]
TASK = "parity_mc"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # lm_eval's default delimiter, a space between context and choice: HFLM moves a context's trailing spaces too.
    return write_task(tmp_path_factory.mktemp("tasks") / TASK, DOCUMENTS, TASK, target_delimiter=" ").parent


def trained_and_exported(root: Path, shard_dir: Path, *overrides: str) -> tuple[Path, Path]:
    """The last checkpoint of a six-step tiny next-token run, and its Hugging Face export."""
    base = [f"paths.output_dir={root}", f"paths.log_dir={root}/logs", f"data.dir={shard_dir}", "trainer.max_steps=6"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        train(compose("train", overrides=[*base, *tiny_run("clm_tiny"), *overrides]))
    checkpoint = root / "checkpoints" / "last.ckpt"
    export_main = pytest.importorskip("pretraining.extras.hf.cli", reason="the parity test exports with hf").main
    export_main([str(checkpoint), str(root / "export")])
    return checkpoint, root / "export"


def choice_scores(samples: list[dict[str, Any]]) -> list[list[tuple[float, bool]]]:
    """Each document's (log-likelihood, is_greedy) per choice, in document order."""
    ordered = sorted(samples, key=lambda sample: sample["doc_id"])
    return [[tuple(response[0]) for response in sample["resps"]] for sample in ordered]


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_the_in_loop_score_is_hflms_on_the_export(
    tokenizer: str, task_dir: Path, shard_dir: Path, bpe_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    overrides = ["tokenizer=bpe", f"tokenizer.path={bpe_path}"] if tokenizer == "bpe" else []
    checkpoint, export = trained_and_exported(tmp_path, shard_dir, *overrides)
    model, _, examples = stored_model(load_checkpoint(checkpoint), str(checkpoint))
    assert max(len(examples.tokenizer.encode(d["context"])) for d in DOCUMENTS) > model.backbone.max_seq_len

    task = HarnessTask(TASK, [task_dir], examples.tokenizer, batch_size=4)
    task.check(model)
    ours = task.run(model, log_samples=True)
    theirs = simple_evaluate(
        model=HFLM(pretrained=str(export), batch_size=4, device="cpu"),
        tasks=[TASK],
        task_manager=TaskManager(include_path=[str(task_dir)], include_defaults=False),
        log_samples=True,
    )
    assert theirs is not None
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASK][metric] == theirs["results"][TASK][metric]
    our_scores, their_scores = choice_scores(ours["samples"][TASK]), choice_scores(theirs["samples"][TASK])
    assert [len(document) for document in our_scores] == [len(document["choices"]) for document in DOCUMENTS]
    for our_document, their_document in zip(our_scores, their_scores, strict=True):
        assert [greedy for _, greedy in our_document] == [greedy for _, greedy in their_document]
        assert [score for score, _ in our_document] == pytest.approx([s for s, _ in their_document], abs=1e-4)
