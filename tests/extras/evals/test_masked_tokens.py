"""Masked-token accuracy on held-out text: it equals a direct computation at the objective's validation masks,
stays the same across evaluations, batch sizes and numbers of ranks, and every bad input is refused in one line."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from evals.test_retrieval import simulated_ranks

from conftest import fit_batch
from pretraining.data.formats import PackedBlocks
from pretraining.data.tokenizer import MASK_ID, ByteTokenizer
from pretraining.errors import ConfigError, MissingFileError
from pretraining.extras.evals.masked_tokens import MaskedTokenTask
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.language_model import IGNORE
from pretraining.objectives.masked_lm import MaskedLM, mask_tokens

BLOCKS = PackedBlocks(ByteTokenizer(), block_size=32)
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "x = 1",
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n",  # longer than a block: cut
    "import os\nimport sys\n",
    "for i in range(10):\n    print(i)\n",
]


def write_texts(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def held_out(tmp_path: Path) -> Path:
    return write_texts(tmp_path / "heldout.jsonl", [json.dumps({"text": text}) for text in TEXTS])


@pytest.fixture(scope="module")
def model() -> MaskedLM:
    """A masked LM trained a little on the texts (so some masked tokens come out right), with validation
    masks other than its training masks."""
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=260, max_seq_len=64, d_model=32, n_layer=1, n_head=2, causal=False)
    options: dict[str, Any] = {"mask_rate": 0.3, "eval_mask_rate": 0.2, "seed": 1, "eval_seed": 7}
    mlm = MaskedLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-2), **options)
    blocks = torch.stack([torch.tensor(BLOCKS.encode_text(text * 8, 33)) for text in TEXTS])
    fit_batch(mlm, {"tokens": blocks, "sample_id": torch.arange(len(TEXTS))}, steps=40, lr=1e-2)
    return mlm.eval()


def direct_metrics(model: MaskedLM) -> dict[str, float]:
    """The metrics computed text by text, each alone and unpadded, its line number its sample id."""
    nll, selected, correct, masked, masked_correct = 0.0, 0, 0, 0, 0
    for line, text in enumerate(TEXTS, 1):
        ids = torch.tensor([BLOCKS.encode_text(text, 32)])
        inputs, positions, labels = mask_tokens(
            ids, torch.tensor([line]), 0.2, 7, 260, model.mask_prob, model.random_prob
        )
        assert positions.shape[1] == max(1, round(0.2 * ids.shape[1]))  # at the validation rate, its own length
        with torch.no_grad():
            logits = model.backbone.logits(model.backbone(inputs)[0, positions[0]])
        labels, counted = labels[0], labels[0] != IGNORE
        hit = (logits.argmax(-1) == labels) & counted
        at_mask = (inputs[0, positions[0]] == MASK_ID) & counted
        nll += F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum").item()
        selected, correct = selected + int(counted.sum()), correct + int(hit.sum())
        masked, masked_correct = masked + int(at_mask.sum()), masked_correct + int((at_mask & hit).sum())
    return {"accuracy": correct / selected, "accuracy_mask": masked_correct / masked, "loss": nll / selected}


def test_the_accuracy_equals_a_direct_computation_at_the_validation_masks(model: MaskedLM, tmp_path: Path) -> None:
    task = MaskedTokenTask("heldout", held_out(tmp_path), BLOCKS)
    task.check(model)
    metrics = task.evaluate(model)
    expected = direct_metrics(model)
    assert metrics == pytest.approx(expected, abs=1e-5, rel=0)
    assert 0 < metrics["accuracy"] < 1 and 0 < metrics["accuracy_mask"] < 1
    assert task.evaluate(model) == metrics  # the same masks at every evaluation
    limited = MaskedTokenTask("heldout", tmp_path / "heldout.jsonl", BLOCKS, limit=2)
    assert limited.lines == [(1, TEXTS[0]), (2, TEXTS[1])]


def test_batching_and_the_number_of_ranks_do_not_change_the_metrics(
    model: MaskedLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = held_out(tmp_path)
    expected = MaskedTokenTask("heldout", path, BLOCKS, batch_size=16).evaluate(model)
    assert MaskedTokenTask("heldout", path, BLOCKS, batch_size=1).evaluate(model) == pytest.approx(expected, abs=1e-6)
    for world in (2, 3, 7):  # 7 ranks for 5 texts: two encode a filler batch alone
        task = MaskedTokenTask("heldout", path, BLOCKS, batch_size=2)
        task.check(model)  # tokenised before the threads share it
        results, sizes = simulated_ranks(monkeypatch, world, lambda task=task: task.evaluate(model))
        assert sum(sizes[0]) == len(TEXTS) and max(sizes[0]) < len(TEXTS)
        for metrics in results:
            assert metrics == pytest.approx(expected, abs=1e-6, rel=0)


def refusal(file: Path, model: Any) -> str:
    with pytest.raises(ConfigError) as raised:
        MaskedTokenTask("heldout", file, BLOCKS).check(model)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_each_bad_input_is_refused_in_one_line_naming_it(model: MaskedLM, tmp_path: Path) -> None:
    causal = CausalLM(
        Transformer(vocab_size=260, max_seq_len=16, d_model=16, n_layer=1, n_head=2), optimizer=torch.optim.AdamW
    )
    message = refusal(held_out(tmp_path), causal)
    assert message.startswith("eval task heldout is a masked-token task") and "CausalLM" in message
    with pytest.raises(MissingFileError, match=r"gone\.jsonl is missing"):
        MaskedTokenTask("heldout", tmp_path / "gone.jsonl", BLOCKS).check(model)
    bad = write_texts(tmp_path / "bad.jsonl", ['{"text": "a"}', '{"text": "b"'])
    assert refusal(bad, model).startswith(f"{bad}:2: not JSON")
    wrong = write_texts(tmp_path / "wrong.jsonl", ['{"text": "a"}', "", '{"text": 5}'])
    assert refusal(wrong, model) == f"{wrong}:3: must be a JSON object with the string fields ['text']"
    empty = write_texts(tmp_path / "empty.jsonl", ["", "  "])
    assert refusal(empty, model).startswith(f"{empty} holds no text")
    blank = write_texts(tmp_path / "blank.jsonl", ['{"text": "a"}', '{"text": ""}'])
    assert refusal(blank, model) == f"{blank}:2: the text has no token: remove the line"
    with pytest.raises(ConfigError, match="batch_size=0"):
        MaskedTokenTask("heldout", bad, BLOCKS, batch_size=0)
