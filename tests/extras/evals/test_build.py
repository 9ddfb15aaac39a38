"""`pretrain-evals build`: well-formed items drawn from the validation split alone, none of whose text occurs in
training (copies planted there are left out), the same for a seed and other for another, harness tasks that
lm-evaluation-harness loads offline from any working directory, BEIR files whose qrels name their ids, a suite
replaced whole or not at all, and bad input refused in one line naming the fix."""

from __future__ import annotations

import itertools
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from conftest import STDLIB_SAMPLE_SOURCES, stdlib_sample_files
from pretraining.data.documents import Document
from pretraining.data.manifest import Manifest
from pretraining.data.reader import SampleReader
from pretraining.data.shards import BuildSettings, build_shards, split_of
from pretraining.errors import ConfigError, ShardError
from pretraining.extras.evals import build as build_module
from pretraining.extras.evals.build import build_suite
from pretraining.extras.evals.bundled import DOCSTRING_CODE, FUNCTION_NAME, HELDOUT_TEXT, NEXT_LINE
from pretraining.extras.evals.cli import main
from pretraining.extras.evals.task import SUITE_FILE

HARNESS = (NEXT_LINE, FUNCTION_NAME)


@pytest.fixture(scope="module")
def suite(shard_dir: Path, pair_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("suite") / "evals"
    build_suite(shard_dir, pair_dir, out)
    return out


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def items(suite: Path, task: str) -> list[dict[str, Any]]:
    return records(suite / task / f"{task}.jsonl")


def normalised(text: str) -> str:
    """Stripped non-blank lines, framed by newlines: containment of whole lines."""
    return "\n" + "\n".join(line.strip() for line in text.splitlines() if line.strip()) + "\n"


def split_texts(directory: Path, split: str, field: str) -> list[str]:
    manifest = Manifest.load(directory)
    return [text for (text,) in SampleReader((field,)).all_texts(manifest.urls(split))]


def item_texts(suite: Path) -> dict[str, list[str]]:
    """Each task's item texts as they would occur in a source file."""
    return {
        NEXT_LINE: [item["context"] + item["choices"][item["label"]] for item in items(suite, NEXT_LINE)],
        FUNCTION_NAME: ["def " + item["choices"][item["label"]] for item in items(suite, FUNCTION_NAME)],
        DOCSTRING_CODE: [record["text"] for record in records(suite / DOCSTRING_CODE / "corpus.jsonl")],
        HELDOUT_TEXT: [item["text"] for item in items(suite, HELDOUT_TEXT)],
    }


def test_items_are_well_formed_and_from_the_validation_split(suite: Path, shard_dir: Path) -> None:
    described = json.loads((suite / SUITE_FILE).read_text())
    assert described["source"]["split"] == "validation" and described["source"]["seed"] == 0
    assert described["source"]["data_version"] == Manifest.load(shard_dir).version
    for task in HARNESS:
        assert described["tasks"][task]["chance"] == {"acc": 0.25, "acc_norm": 0.25}
        for item in items(suite, task):
            assert len(set(item["choices"])) == 4 and 0 <= item["label"] < 4
    for item in items(suite, NEXT_LINE):
        assert item["context"].endswith("\n") and len(item["context"].splitlines()) >= 2
        assert all(choice.endswith("\n") and choice.count("\n") == 1 for choice in item["choices"])
        indents = {len(choice) - len(choice.lstrip()) for choice in item["choices"]}
        assert len(indents) == 1  # the distractors have the real line's indentation
        assert len((item["context"] + max(item["choices"], key=len)).encode()) <= 256
    for item in items(suite, FUNCTION_NAME):
        names = [re.match(r"\w+", choice).group() for choice in item["choices"]]  # type: ignore[union-attr]
        assert item["context"] == "def " and len({len(name) for name in names}) == 1
        # Each choice is the same function with only its name changed, everywhere.
        assert len({re.sub(rf"\b{name}\b", "NAME", c) for name, c in zip(names, item["choices"], strict=True)}) == 1
    validation = [normalised(text) for text in split_texts(shard_dir, "validation", "txt")]
    for task, texts in item_texts(suite).items():
        assert len(texts) == described["tasks"][task]["items"] >= 20, task
        if task != DOCSTRING_CODE:  # docstrings cut out
            assert all(any(normalised(text) in file for file in validation) for text in texts), task


def test_no_item_text_occurs_in_training(suite: Path, shard_dir: Path, pair_dir: Path) -> None:
    training = [*split_texts(shard_dir, "train", "txt"), *split_texts(pair_dir, "train", "passage.txt")]
    training = [normalised(text) for text in training]
    for task, texts in item_texts(suite).items():
        assert not [text for text in texts if any(normalised(text) in document for document in training)], task


def copies(functions: list[str]) -> str:
    """A training file holding `functions`, re-indented as methods (a copy need not be byte for byte)."""
    return "class Copies:\n" + "\n\n".join(textwrap.indent(function, "    ") for function in functions) + "\n"


def test_functions_copied_into_training_are_left_out(suite: Path, pair_dir: Path, tmp_path: Path) -> None:
    chosen = item_texts(suite)
    # The small split's candidates are all used: a planted function not left out would be drawn again.
    planted = chosen[FUNCTION_NAME][:2] + chosen[HELDOUT_TEXT][:10]
    source_id = next(
        f"stdlib:copies{i}.py" for i in itertools.count() if split_of(f"stdlib:copies{i}.py", 0.2) == "train"
    )
    documents = itertools.chain(stdlib_sample_files(), [Document(source_id, {"txt": copies(planted)})])
    settings = BuildSettings(validation_fraction=0.2, max_shard_bytes=100_000)
    build_shards(documents, tmp_path / "shards", STDLIB_SAMPLE_SOURCES, settings, show_progress=False)
    build_suite(tmp_path / "shards", pair_dir, tmp_path / "evals")
    rebuilt = item_texts(tmp_path / "evals")
    found = [normalised(text) for text in rebuilt[FUNCTION_NAME] + rebuilt[HELDOUT_TEXT]]
    assert not [text for text in planted if any(normalised(text) in item for item in found)]


def task_files(suite: Path) -> dict[str, bytes]:
    """The suite's files but the YAMLs (which name the suite's own path)."""
    return {
        str(p.relative_to(suite)): p.read_bytes()
        for p in sorted(suite.rglob("*"))
        if p.is_file() and p.suffix != ".yaml"
    }


def test_a_seed_draws_the_same_suite_and_another_seed_another(
    suite: Path, shard_dir: Path, pair_dir: Path, tmp_path: Path
) -> None:
    build_suite(shard_dir, pair_dir, tmp_path / "again")
    assert task_files(tmp_path / "again") == task_files(suite)
    build_suite(shard_dir, pair_dir, tmp_path / "other", seed=1)
    other = task_files(tmp_path / "other")
    for task in (NEXT_LINE, FUNCTION_NAME, HELDOUT_TEXT):
        assert other[f"{task}/{task}.jsonl"] != task_files(suite)[f"{task}/{task}.jsonl"]
    assert other[f"{DOCSTRING_CODE}/queries.jsonl"] != task_files(suite)[f"{DOCSTRING_CODE}/queries.jsonl"]


def test_lm_eval_loads_the_harness_tasks_offline_from_anywhere(
    suite: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # the data files' paths do not depend on the working directory
    loaded = TaskManager(include_path=[str(suite)]).load_task_or_group(list(HARNESS))
    for name in HARNESS:
        task, written = loaded[name], items(suite, name)
        docs = list(task.test_docs())
        assert len(docs) == len(written)
        assert task.config.target_delimiter == ""  # the context ends where the choice starts
        for doc, item in zip(docs, written, strict=True):
            assert task.doc_to_text(doc) == item["context"]
            assert task.doc_to_choice(doc) == item["choices"] and task.doc_to_target(doc) == item["label"]


def test_the_retrieval_task_is_in_the_beir_layout(suite: Path) -> None:
    corpus = records(suite / DOCSTRING_CODE / "corpus.jsonl")
    queries = records(suite / DOCSTRING_CODE / "queries.jsonl")
    assert all(set(record) == {"_id", "title", "text"} for record in corpus)
    assert all(set(record) == {"_id", "text"} for record in queries)
    header, *rows = (
        line.split("\t") for line in (suite / DOCSTRING_CODE / "qrels" / "test.tsv").read_text().splitlines()
    )
    assert header == ["query-id", "corpus-id", "score"]
    assert {query for query, _, _ in rows} == {record["_id"] for record in queries}
    assert {document for _, document, _ in rows} == {record["_id"] for record in corpus}
    assert len(rows) == len(queries) == len(corpus) == len({record["text"] for record in corpus})
    chance = json.loads((suite / SUITE_FILE).read_text())["tasks"][DOCSTRING_CODE]["chance"]
    n = len(corpus)
    assert chance["recall@10"] == pytest.approx(10 / n)
    assert chance["mrr@10"] == pytest.approx(sum(1 / k for k in range(1, 11)) / n)


def test_a_failed_build_leaves_the_suite_as_it_was(
    shard_dir: Path, pair_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "evals"
    build_suite(shard_dir, pair_dir, out)
    before = task_files(out) | {"yaml": (out / NEXT_LINE / f"{NEXT_LINE}.yaml").read_bytes()}
    with pytest.raises(ShardError):
        build_suite(tmp_path / "missing", pair_dir, out, seed=1)
    written = []

    def write_then_fail(path: Path, data: bytes) -> None:
        if len(written) == 3:
            raise OSError("disk full")
        written.append(path)
        path.write_bytes(data)

    monkeypatch.setattr(build_module, "write_atomically", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        build_suite(shard_dir, pair_dir, out, seed=1)
    assert task_files(out) | {"yaml": (out / NEXT_LINE / f"{NEXT_LINE}.yaml").read_bytes()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["evals"]  # no temporary left
    monkeypatch.undo()
    build_suite(shard_dir, pair_dir, out, seed=1)  # a good build replaces it
    assert json.loads((out / SUITE_FILE).read_text())["source"]["seed"] == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["evals"]


def refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line `pretrain-evals build` exits with."""
    with pytest.raises(SystemExit) as exited:
        main(["build", *args])
    message = str(exited.value.code)
    assert message.startswith("pretrain-evals: ") and "\n" not in message and "Traceback" not in capsys.readouterr().err
    return message


def few_functions(directory: Path) -> Path:
    """Text shards whose validation split is one small file."""
    file = "def first(x):\n    y = x + 1\n    return y\n"
    ids = (f"file{i}.py" for i in itertools.count())
    validation = next(name for name in ids if split_of(name, 0.5) == "validation")
    train = next(name for name in ids if split_of(name, 0.5) == "train")
    documents = [Document(validation, {"txt": file}), Document(train, {"txt": file.replace("first", "second")})]
    build_shards(documents, directory, ["few"], BuildSettings(validation_fraction=0.5), show_progress=False)
    return directory


def test_bad_input_is_refused_in_one_line_naming_the_fix(
    shard_dir: Path, pair_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "evals")]
    assert "build the shards there" in refusal(capsys, "--data", str(tmp_path / "none"), "--pairs", str(pair_dir), *out)
    assert "pass text shards" in refusal(capsys, "--data", str(pair_dir), "--pairs", str(pair_dir), *out)
    assert "pass pair shards" in refusal(capsys, "--data", str(shard_dir), "--pairs", str(shard_dir), *out)
    no_validation = tmp_path / "no_validation"
    build_shards(
        stdlib_sample_files(), no_validation, ["x"], BuildSettings(validation_fraction=0.0), show_progress=False
    )
    message = refusal(capsys, "--data", str(no_validation), "--pairs", str(pair_dir), *out)
    assert "lists no 'validation' shards" in message and "--validation-fraction" in message
    message = refusal(capsys, "--data", str(few_functions(tmp_path / "few")), "--pairs", str(pair_dir), *out)
    assert "fewer than 20" in message and "larger --validation-fraction" in message
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    message = refusal(capsys, "--data", str(shard_dir), "--pairs", str(pair_dir), "--out", str(tmp_path / "other"))
    assert "choose a new or empty directory" in message and (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "evals").exists()


def test_the_command_reports_each_task(
    shard_dir: Path, pair_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(
        ["build", "--data", str(shard_dir), "--pairs", str(pair_dir), "--out", str(tmp_path / "evals"), "--items", "30"]
    )
    printed = capsys.readouterr().out
    described = json.loads((tmp_path / "evals" / SUITE_FILE).read_text())
    assert all(task["items"] <= 30 for task in described["tasks"].values())
    assert all(
        f"{name} ({task['kind']}): {task['items']} items" in printed for name, task in described["tasks"].items()
    )
    with pytest.raises(ConfigError):  # an --out that is a file
        build_suite(shard_dir, pair_dir, tmp_path / "evals" / SUITE_FILE)
