"""The bundled suite's four tasks (docs/evals.md), made from the held-out functions of a validation split:
`pretraining.extras.evals.build` reads the shards, keeps training text out and writes what these return.

Each task draws its items with its own random generator (the seed and the task's name), so a task's items do not
change when another task changes, and keeps a candidate item only if its text does not occur in training.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pretraining.data.documents import Document
from pretraining.data.manifest import PAIR_FIELDS
from pretraining.data.pairs import docstring_pairs
from pretraining.extras.evals.retrieval import QRELS_HEADER

SUITE_VERSION = 1
NEXT_LINE, FUNCTION_NAME = "stdlib_next_line", "stdlib_function_name"
DOCSTRING_CODE, HELDOUT_TEXT = "stdlib_docstring_code", "stdlib_heldout_text"
CHOICES = 4
CONTEXT_LINES = 20  # the most lines of a next-line context
LONGEST_LINE = 80  # bytes of a next-line choice (PEP 8's limit, nearly)
SHORT_FUNCTION_LINES = 12  # the most lines of a function whose name is asked
DEPTHS = {"mrr@10": 10, "map@100": 100}  # the reciprocal-rank metrics of `retrieval`, to their depth


@dataclass(frozen=True)
class Function:
    """A function or method of a validation file: its source from `def`, dedented."""

    source_id: str
    qualname: str
    code: str

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


@dataclass
class SuiteTask:
    """One task of the suite: its entry in suite.json and its files (paths relative to its folder)."""

    name: str
    kind: str
    items: int
    chance: dict[str, float]
    description: str
    files: dict[str, bytes] = field(default_factory=dict)

    def entry(self) -> dict[str, Any]:
        return {"kind": self.kind, "items": self.items, "chance": self.chance, "description": self.description}


Item = dict[str, Any]


def take(
    candidates: Iterable[Item | None], count: int, training: Container[str], text: Callable[[Item], str]
) -> list[Item]:
    """The first `count` candidates (None: unusable) whose `text(item)` does not occur in `training`."""
    items = []
    for item in candidates:
        if item is not None and text(item) not in training:
            items.append(item)
            if len(items) == count:
                break
    return items


def shuffled(values: Sequence[Any], rng: random.Random) -> list[Any]:
    """A copy of `values` in a random order."""
    return rng.sample(list(values), len(values))


def next_line_item(function: Function, pools: dict[str, list[str]], rng: random.Random, budget: int) -> dict | None:
    """A cut after two lines or more of `function`: its real next line among three other functions' lines of
    the same indentation, the context its last lines (at most CONTEXT_LINES) that fit `budget` bytes with any
    choice."""
    lines = function.code.splitlines()
    cuts = [k for k in range(2, len(lines)) if lines[k].strip() and len(lines[k].encode()) < LONGEST_LINE]
    if not cuts:
        return None
    cut = rng.choice(cuts)
    answer = lines[cut]
    pool = pools[answer[: len(answer) - len(answer.lstrip())]]
    own = set(lines)
    distractors = [line for line in rng.sample(pool, min(len(pool), 8 * CHOICES)) if line not in own]
    if len(distractors) < CHOICES - 1:
        return None
    choices = [f"{line}\n" for line in shuffled([answer, *distractors[: CHOICES - 1]], rng)]
    room = budget - max(len(choice.encode()) for choice in choices)
    context: list[str] = []
    for line in reversed(lines[max(0, cut - CONTEXT_LINES) : cut]):
        if len("".join([line, *context]).encode()) + len(context) + 1 > room:
            break
        context.insert(0, line)
    if len(context) < 2:
        return None
    return {"context": "\n".join(context) + "\n", "choices": choices, "label": choices.index(f"{answer}\n")}


def next_line_task(
    functions: list[Function], training: Container[str], seed: int, count: int, budget: int
) -> SuiteTask:
    rng = random.Random(f"{seed}/{NEXT_LINE}")
    pools: dict[str, list[str]] = {}
    for function in functions:
        for line in function.code.splitlines():
            if line.strip() and len(line.encode()) < LONGEST_LINE:
                pools.setdefault(line[: len(line) - len(line.lstrip())], []).append(line)
    pools = {indent: list(dict.fromkeys(lines)) for indent, lines in pools.items()}
    candidates = (next_line_item(function, pools, rng, budget) for function in shuffled(functions, rng))
    items = take(candidates, count, training, lambda item: item["context"] + item["choices"][item["label"]])
    description = (
        "which line comes next in a validation-split function: the real one or one of 3 lines of other "
        "functions with the same indentation"
    )
    return harness_task(NEXT_LINE, items, description)


def function_name_item(function: Function, names: dict[int, list[str]], rng: random.Random, budget: int) -> dict | None:
    """`def ` and four versions of a short function, its name replaced everywhere by the real one or one of three
    other functions' names of the same length (and not a word of the function)."""
    words = set(re.findall(r"\w+", function.code))
    others = [name for name in names.get(len(function.name), []) if name not in words]
    if len(others) < CHOICES - 1:
        return None
    candidates = shuffled([function.name, *rng.sample(others, CHOICES - 1)], rng)
    pattern = re.compile(rf"\b{re.escape(function.name)}\b")
    choices = [pattern.sub(name, function.code.removeprefix("def ")) for name in candidates]
    if max(len(f"def {choice}".encode()) for choice in choices) > budget:
        return None
    return {"context": "def ", "choices": choices, "label": candidates.index(function.name)}


def function_name_task(
    functions: list[Function], training: Container[str], seed: int, count: int, budget: int
) -> SuiteTask:
    rng = random.Random(f"{seed}/{FUNCTION_NAME}")
    named = [function for function in functions if not re.fullmatch(r"__\w+__", function.name)]
    names: dict[int, list[str]] = {}
    for name in dict.fromkeys(function.name for function in named):
        names.setdefault(len(name), []).append(name)
    short = [function for function in named if len(function.code.splitlines()) <= SHORT_FUNCTION_LINES]
    candidates = (function_name_item(function, names, rng, budget) for function in shuffled(short, rng))
    items = take(candidates, count, training, lambda item: "def " + item["choices"][item["label"]])
    description = (
        "which name a short validation-split function has: its source after `def ` with its name replaced "
        "everywhere by the real one or one of 3 other functions' names of the same length"
    )
    return harness_task(FUNCTION_NAME, items, description)


def harness_task(name: str, items: list[dict[str, Any]], description: str) -> SuiteTask:
    """A multiple-choice task: its lm-evaluation-harness YAML (data file path filled in at writing) and jsonl."""
    task = SuiteTask(name, "harness", len(items), {"acc": 1 / CHOICES, "acc_norm": 1 / CHOICES}, description)
    task.files[f"{name}.jsonl"] = jsonl(items)
    return task


def harness_yaml(name: str, data_file: Path) -> bytes:
    """The task's YAML; the data file's path absolute, since `datasets` reads a relative one from the working
    directory, not from the YAML's."""
    metrics = [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in ("acc", "acc_norm")]
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": "",  # contexts end where the choices start (a newline, or `def `)
        "metric_list": metrics,
        "metadata": {"version": SUITE_VERSION},
    }
    return yaml.safe_dump(config, sort_keys=False).encode()


def docstring_code_task(
    files: list[tuple[str, str]], unseen: list[Function], training: Container[str], seed: int, count: int
) -> SuiteTask:
    """Each documented definition's docstring as a query, its code without docstrings as its only relevant
    document (`docstring_pairs`, as the pair shards are built), of the definitions kept by `held_out`."""
    rng = random.Random(f"{seed}/{DOCSTRING_CODE}")
    kept = {(function.source_id, function.qualname) for function in unseen}
    pairs = docstring_pairs(Document(source_id, {"txt": text}) for source_id, text in files)
    found: dict[str, str] = {}  # one pair per query text and per code: a repeated one would be ambiguous
    for pair in pairs:
        assert pair.texts is not None
        query, code = pair.texts[PAIR_FIELDS[0]], pair.texts[PAIR_FIELDS[1]]
        if (pair.source_id, pair.meta["name"]) in kept and query not in found and code not in found.values():
            found[query] = code
    candidates = ({"query": query, "code": code} for query, code in shuffled(sorted(found.items()), rng))
    items = take(candidates, count, training, lambda item: item["code"])
    task = SuiteTask(
        DOCSTRING_CODE, "retrieval", len(items), random_ranking(len(items)), "find a function's code by its docstring"
    )
    task.files["corpus.jsonl"] = jsonl({"_id": f"c{i}", "title": "", "text": x["code"]} for i, x in enumerate(items))
    task.files["queries.jsonl"] = jsonl({"_id": f"q{i}", "text": x["query"]} for i, x in enumerate(items))
    qrels = "".join(f"q{i}\tc{i}\t1\n" for i in range(len(items)))
    task.files["qrels/test.tsv"] = ("\t".join(QRELS_HEADER) + "\n" + qrels).encode()
    return task


def random_ranking(n: int) -> dict[str, float]:
    """The expected metrics of a random ranking of `n` documents, one of them relevant (at rank r, each with
    chance 1/n): recall@k = k/n, a reciprocal rank to depth d = H_d/n, nDCG@10 = sum of 1/log2(r+1) to 10, / n."""
    if not n:
        return {}
    chance = {f"recall@{k}": min(k, n) / n for k in (1, 10)} | {"accuracy@1": 1 / n}
    chance |= {metric: harmonic(min(depth, n)) / n for metric, depth in DEPTHS.items()}
    return chance | {"ndcg@10": sum(1 / math.log2(rank + 1) for rank in range(1, min(10, n) + 1)) / n}


def harmonic(n: int) -> float:
    """1 + 1/2 + ... + 1/n."""
    return sum(1 / k for k in range(1, n + 1))


def heldout_text_task(
    functions: list[Function], training: Container[str], seed: int, count: int, budget: int
) -> SuiteTask:
    """Each a function's first lines (two at least) that fit `budget` bytes, for masked-token accuracy."""
    rng = random.Random(f"{seed}/{HELDOUT_TEXT}")

    def piece(function: Function) -> dict[str, str] | None:
        lines = function.code.splitlines()
        fit = next((k for k in range(len(lines), 1, -1) if len("\n".join(lines[:k]).encode()) <= budget), 0)
        return {"text": "\n".join(lines[:fit])} if fit >= 2 else None

    items = take((piece(function) for function in shuffled(functions, rng)), count, training, lambda x: x["text"])
    counts = Counter(byte for item in items for byte in item["text"].encode())
    chance = {"accuracy": max(counts.values()) / counts.total()} if counts else {}
    description = "validation-split functions' first lines; chance: always the most frequent byte (bytes tokenizer)"
    task = SuiteTask(HELDOUT_TEXT, "masked_tokens", len(items), chance, description)
    task.files[f"{HELDOUT_TEXT}.jsonl"] = jsonl(items)
    return task


def jsonl(records: Iterable[Item]) -> bytes:
    """One JSON object a line, UTF-8."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode()
