"""The live model inside lm-evaluation-harness: its log-likelihoods, pseudo-log-likelihoods, rolling windows and
greedy continuations are the model's own, a model that knows the answers scores 1.0, and each bad task input is
refused at check in one line."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from lm_eval.api.instance import Instance

from conftest import fit_batch, free_port
from pretraining.data.tokenizer import EOS_ID, MASK_ID, ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.extras.evals.bundled import harness_yaml
from pretraining.extras.evals.harness import HarnessTask
from pretraining.extras.evals.lm import LiveLM
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.masked_lm import MaskedLM

TOKENIZER = ByteTokenizer()
CONTEXTS = ["def add(a, b):\n    return a", "import o", "for i in range(1", "class Tree(object", "x = [1, 2"]
PRINTABLE = [TOKENIZER.encode(chr(c))[0] for c in range(33, 127)]  # one byte each, no whitespace
MAX_SEQ_LEN = 64


def causal_lm() -> CausalLM:
    torch.manual_seed(0)
    backbone = Transformer(vocab_size=TOKENIZER.vocab_size, max_seq_len=MAX_SEQ_LEN, d_model=32, n_layer=1, n_head=2)
    return CausalLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-2)).eval()


def masked_lm() -> MaskedLM:
    torch.manual_seed(0)
    backbone = Transformer(
        vocab_size=TOKENIZER.vocab_size, max_seq_len=MAX_SEQ_LEN, d_model=32, n_layer=1, n_head=2, causal=False
    )
    return MaskedLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-2)).eval()


def write_task(folder: Path, rows: list[dict[str, Any]], name: str = "tiny_mc", **settings: Any) -> Path:
    """A multiple-choice task in the bundled suite's layout (its YAML + jsonl), `settings` replacing the YAML's."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(harness_yaml(name, data)) | settings))
    return path


def requests(kind: str, *arguments: tuple) -> list[Instance]:
    return [Instance(kind, {}, argument, index) for index, argument in enumerate(arguments)]


def direct_log_likelihood(model: CausalLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log P(continuation | context) from one forward of the model's logits, the last max_seq_len tokens in."""
    tokens = torch.tensor([(context + continuation)[-(MAX_SEQ_LEN + 1) :]])
    with torch.no_grad():
        log_probs = model(tokens[:, :-1])[0].log_softmax(-1)[-len(continuation) :]
    target = torch.tensor(continuation)
    return float(log_probs[torch.arange(len(target)), target].sum()), bool((log_probs.argmax(-1) == target).all())


PAIRS = [("def add(a, b):", " return a + b"), ("x = ", "1"), ("", "import os"), ("#" * 100, " long context")]


def test_log_likelihoods_are_the_models_own_with_hflms_token_split_and_do_not_depend_on_the_batch() -> None:
    model = causal_lm()
    scores = LiveLM(model, TOKENIZER, batch_size=3).loglikelihood(requests("loglikelihood", *PAIRS))
    for (context, continuation), (score, greedy) in zip(PAIRS, scores, strict=True):
        moved = context[len(context.rstrip()) :]  # trailing spaces of the context belong to the continuation
        before = TOKENIZER.encode(context.rstrip()) if context else [EOS_ID]
        expected, expected_greedy = direct_log_likelihood(model, before, TOKENIZER.encode(moved + continuation))
        assert score == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy
    one_by_one = LiveLM(model, TOKENIZER, batch_size=1).loglikelihood(requests("loglikelihood", *PAIRS))
    assert [score for score, _ in one_by_one] == pytest.approx([score for score, _ in scores], abs=1e-5)


def test_pseudo_log_likelihood_masks_one_continuation_token_at_a_time() -> None:
    model = masked_lm()
    scores = LiveLM(model, TOKENIZER, batch_size=5).loglikelihood(requests("loglikelihood", *PAIRS))
    for (context, continuation), (score, _) in zip(PAIRS, scores, strict=True):
        before = TOKENIZER.encode(context.rstrip()) if context else [EOS_ID]
        after = TOKENIZER.encode(context[len(context.rstrip()) :] + continuation)
        tokens = (before + after)[-MAX_SEQ_LEN:]
        expected = 0.0
        for position in range(len(tokens) - len(after), len(tokens)):
            masked = torch.tensor([[*tokens[:position], MASK_ID, *tokens[position + 1 :]]])
            with torch.no_grad():
                log_probs = model.backbone.logits(model.backbone(masked))[0, position].log_softmax(-1)
            expected += float(log_probs[tokens[position]])
        assert score == pytest.approx(expected, abs=1e-4)
    one_by_one = LiveLM(model, TOKENIZER, batch_size=1).loglikelihood(requests("loglikelihood", *PAIRS))
    assert [score for score, _ in one_by_one] == pytest.approx([score for score, _ in scores], abs=1e-5)


def known_answers(model: CausalLM | MaskedLM) -> list[dict[str, Any]]:
    """Documents whose right choice is the byte the model itself ranks first after the context (among printable
    ones), the others three it ranks lower."""
    rows = []
    for context in CONTEXTS:
        tokens = TOKENIZER.encode(context)
        with torch.no_grad():
            if isinstance(model, CausalLM):
                logits = model(torch.tensor([tokens]))[0, -1]
            else:
                logits = model.backbone.logits(model.backbone(torch.tensor([[*tokens, MASK_ID]])))[0, -1]
        ranked = sorted(PRINTABLE, key=lambda token: -float(logits[token]))
        choices = [TOKENIZER.decode([token]) for token in (ranked[0], ranked[10], ranked[20], ranked[30])]
        rows.append({"context": context, "choices": choices[::-1], "label": 3})
    return rows


@pytest.mark.parametrize("build", [causal_lm, masked_lm])
def test_a_model_that_knows_the_answers_scores_one_again_and_again(build: Any, tmp_path: Path) -> None:
    model = build()
    write_task(tmp_path / "tasks", known_answers(model))
    task = HarnessTask("tiny_mc", [tmp_path / "tasks"], TOKENIZER, batch_size=4)
    task.check(model)
    first = task.evaluate(model)
    assert first["acc"] == 1.0 and first["acc_norm"] == 1.0 and set(first) >= {"acc_stderr", "acc_norm_stderr"}
    assert task.evaluate(model) == first  # the loaded task is reused, its requests rebuilt
    assert model.training is False


def test_an_untrained_model_scores_each_document_by_its_own_choices(tmp_path: Path) -> None:
    model = causal_lm()
    rows = known_answers(model)
    rows[0]["label"], rows[1]["label"] = 0, 1  # two answers the model ranks last or third
    write_task(tmp_path / "tasks", rows)
    assert HarnessTask("tiny_mc", [tmp_path / "tasks"], TOKENIZER).evaluate(model)["acc"] == pytest.approx(3 / 5)


def test_rolling_log_likelihood_sums_the_texts_tokens_over_disjoint_windows() -> None:
    model = causal_lm()
    short, long = "def f(x):\n    return x", "".join(chr(97 + i % 26) for i in range(2 * MAX_SEQ_LEN))
    totals = LiveLM(model, TOKENIZER, batch_size=2).loglikelihood_rolling(
        requests("loglikelihood_rolling", (short,), (long,))
    )
    for text, total in zip((short, long), totals, strict=True):
        tokens = TOKENIZER.encode(text)
        shifted = [EOS_ID, *tokens]  # each window predicts its next MAX_SEQ_LEN tokens from those before, in it
        expected = 0.0
        for start in range(0, len(tokens), MAX_SEQ_LEN):
            window = torch.tensor([shifted[start : start + MAX_SEQ_LEN]])
            with torch.no_grad():
                log_probs = model(window)[0].log_softmax(-1)
            target = torch.tensor(tokens[start : start + MAX_SEQ_LEN])
            expected += float(log_probs[torch.arange(len(target)), target].sum())
        assert total == pytest.approx(expected, abs=1e-3)


def test_greedy_generation_stops_at_a_stop_sequence_or_after_max_gen_toks() -> None:
    model = causal_lm()
    text = "abcdefgh" * 8
    fit_batch(model, {"tokens": torch.tensor([TOKENIZER.encode(text)[:MAX_SEQ_LEN]])}, steps=60, lr=1e-2)
    model.eval()
    lm = LiveLM(model, TOKENIZER, batch_size=2)
    asked = requests(
        "generate_until",
        ("abcdefgh" * 2, {"until": ["f"], "max_gen_toks": 20}),
        ("abcdefgh" * 2, {"until": ["\n\n"], "max_gen_toks": 5}),
        ("bcdefgh", {"until": ["xy", "cd"], "max_gen_toks": 20}),
    )
    assert lm.generate_until(asked) == ["abcde", "abcde", "ab"]


def generation_requests() -> list[Instance]:
    return requests(
        "generate_until", *((text, {"until": ["\n"], "max_gen_toks": 4 + i}) for i, text in enumerate(CONTEXTS))
    )


def scores_on_rank(rank: int, port: int, out: Path) -> None:
    """One rank of two: every request's score and every greedy continuation, written to out/<rank>.json."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        scored: dict[str, Any] = {}
        for build in (causal_lm, masked_lm):
            scored[build.__name__] = LiveLM(build(), TOKENIZER, 2).loglikelihood(requests("loglikelihood", *PAIRS))
        scored["generated"] = LiveLM(causal_lm(), TOKENIZER, 2).generate_until(generation_requests())
        (out / f"{rank}.json").write_text(json.dumps(scored))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes importing torch and lm_eval: ~22 s on 2 CPU cores
@pytest.mark.distributed
def test_two_ranks_share_the_requests_and_both_get_every_score(tmp_path: Path) -> None:
    mp.spawn(scores_on_rank, args=(free_port(), tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    for build in (causal_lm, masked_lm):
        alone = LiveLM(build(), TOKENIZER, 2).loglikelihood(requests("loglikelihood", *PAIRS))
        assert [score for score, _ in ranks[0][build.__name__]] == pytest.approx([s for s, _ in alone], abs=1e-5)
        assert [greedy for _, greedy in ranks[0][build.__name__]] == [greedy for _, greedy in alone]
    assert ranks[0]["generated"] == LiveLM(causal_lm(), TOKENIZER, 2).generate_until(generation_requests())


def test_a_masked_lm_refuses_rolling_and_generation() -> None:
    lm = LiveLM(masked_lm(), TOKENIZER)
    with pytest.raises(ConfigError, match="loglikelihood_rolling needs a next-token model"):
        lm.loglikelihood_rolling(requests("loglikelihood_rolling", ("text",)))
    with pytest.raises(ConfigError, match="generate_until needs a next-token model"):
        lm.generate_until(requests("generate_until", ("text", {"until": ["\n"]})))


ROWS = [{"context": "import o", "choices": ["s", "x"], "label": 0}]


def refusal(folder: Path, model: CausalLM | MaskedLM | None = None, name: str = "tiny_mc", **options: Any) -> str:
    """The one-line message `check` refuses the task with."""
    with pytest.raises(ConfigError) as refused:
        HarnessTask(name, [folder], TOKENIZER, **options).check(model or causal_lm())
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_an_unknown_task_names_the_known_ones_and_the_key(tmp_path: Path) -> None:
    write_task(tmp_path, ROWS)
    assert "callbacks.evals.tasks: no task 'hellaswag'" in refusal(tmp_path, name="hellaswag")
    assert "(known: tiny_mc)" in refusal(tmp_path, name="hellaswag")
    assert "task folder" in refusal(tmp_path / "absent")


def test_a_malformed_yaml_is_named_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\nother: 1\n")
    assert refusal(tmp_path, name="broken").startswith(f"{tmp_path / 'broken.yaml'}:3: not valid YAML")


def test_a_dataset_from_the_hub_is_refused(tmp_path: Path) -> None:
    write_task(tmp_path, ROWS, dataset_path="hellaswag", dataset_kwargs=None)
    assert "would download dataset 'hellaswag' from the Hugging Face Hub: give it local files" in refusal(tmp_path)


def test_a_missing_data_file_and_a_line_not_json_are_named(tmp_path: Path) -> None:
    write_task(tmp_path, ROWS, dataset_kwargs={"data_files": {"test": str(tmp_path / "gone.jsonl")}})
    assert f"data file {tmp_path / 'gone.jsonl'} not found" in refusal(tmp_path)
    write_task(tmp_path, ROWS)
    with (tmp_path / "tiny_mc.jsonl").open("a") as data:
        data.write("{not json\n")
    assert refusal(tmp_path).startswith(f"{tmp_path / 'tiny_mc.jsonl'}:2: not JSON")


def test_python_named_by_a_yaml_runs_only_when_trusted(tmp_path: Path) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "utils.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\ndef docs(dataset):\n    return dataset\n"
    )
    write_task(tmp_path, ROWS, name="base")
    (tmp_path / "base.yaml").rename(tmp_path / "base.txt")  # included, not a task of its own
    (tmp_path / "tiny_mc.yaml").write_text("include: base.txt\ntask: tiny_mc\nprocess_docs: !function utils.docs\n")
    message = refusal(tmp_path)
    assert message.startswith(f"{tmp_path / 'tiny_mc.yaml'}:3: `!function utils.docs` would import Python")
    assert "callbacks.evals.trust_task_code=true" in message and not marker.exists()
    task = HarnessTask("tiny_mc", [tmp_path], TOKENIZER, trust_task_code=True)
    task.check(causal_lm())
    assert marker.exists() and set(task.evaluate(causal_lm())) >= {"acc", "acc_norm"}


def test_an_unknown_metric_is_named_before_lm_eval_looks_for_it_online(tmp_path: Path) -> None:
    write_task(tmp_path, ROWS, metric_list=[{"metric": "accuracy"}])
    assert f"{tmp_path / 'tiny_mc.yaml'}: metric 'accuracy' is not one of lm_eval's" in refusal(tmp_path)


def test_a_masked_lm_refuses_a_generation_task(tmp_path: Path) -> None:
    write_task(tmp_path, ROWS, output_type="generate_until", metric_list=[{"metric": "exact_match"}])
    assert "task tiny_mc is generate_until, which needs a next-token model" in refusal(tmp_path, masked_lm())


def test_a_choice_longer_than_the_context_is_refused_and_a_long_context_is_not(tmp_path: Path) -> None:
    write_task(tmp_path, [{"context": "x" * 500, "choices": ["a", "b"], "label": 0}])
    HarnessTask("tiny_mc", [tmp_path], TOKENIZER).check(causal_lm())
    write_task(tmp_path, [*ROWS, {"context": "x", "choices": ["a", "b" * 80], "label": 0}])
    message = refusal(tmp_path, masked_lm())
    assert "task tiny_mc, document 1: a choice of 80 tokens exceeds model.backbone.max_seq_len=64" in message


def test_a_template_cannot_reach_python_and_a_template_lm_eval_cannot_render_is_named(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}{{{{context}}}}"
    write_task(tmp_path, ROWS, doc_to_text=payload)
    message = refusal(tmp_path, trust_task_code=True)  # not even trusted code runs from a template
    assert "lm_eval cannot build the requests of task tiny_mc (SecurityError" in message and not marker.exists()
    write_task(tmp_path, ROWS, doc_to_text="{{question}}")
    assert "(UndefinedError: 'question' is undefined): fix the YAML or its data" in refusal(tmp_path)


def test_a_yaml_that_includes_itself_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("include: tiny_mc.yaml\n")
    write_task(tmp_path, ROWS, include="a.txt")
    assert "tiny_mc.yaml: included by itself" in refusal(tmp_path)


def test_a_generation_without_room_for_a_context_is_refused_at_setup(tmp_path: Path) -> None:
    generation = {"output_type": "generate_until", "doc_to_target": "{{choices[label]}}"}
    generation["metric_list"] = [{"metric": "exact_match"}]
    write_task(tmp_path, ROWS, **generation)  # lm_eval's default: 256 tokens
    message = refusal(tmp_path)
    assert "max_gen_toks=256 (256 where a task names none) leaves no room for a context" in message
    assert f"in model.backbone.max_seq_len={MAX_SEQ_LEN}: give the task a smaller max_gen_toks" in message
    write_task(tmp_path, ROWS, **generation, generation_kwargs={"max_gen_toks": 4})
    HarnessTask("tiny_mc", [tmp_path], TOKENIZER).check(causal_lm())
