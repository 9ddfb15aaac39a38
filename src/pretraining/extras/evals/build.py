"""`pretrain-evals build`: the bundled suite, written from the validation split of text shards built by
`pretrain-data build` (docs/evals.md describes its tasks and their chance levels).

Every item comes from the Python functions of the validation split's files, and none occurs in training: a
function whose source, compared as stripped non-blank lines, also occurs in a training text (the standard library
has copies) is left out, as is every item whose own text (a context with its answer, a function with its real
name, a code passage, a held-out piece) occurs there, in the text shards' or the pair shards' training split.
The items are drawn with a random generator seeded by the seed and the task's name, so a build is a pure
function of the shards and the seed; the suite is written into a temporary directory renamed into place.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pretraining.data.manifest import PAIR_FIELDS, TEXT_FIELDS, Manifest
from pretraining.data.pairs import SourceBytes, definitions
from pretraining.data.reader import SampleReader
from pretraining.errors import ConfigError
from pretraining.extras.evals.bundled import (
    SUITE_VERSION,
    Function,
    SuiteTask,
    docstring_code_task,
    function_name_task,
    harness_yaml,
    heldout_text_task,
    next_line_task,
)
from pretraining.extras.evals.task import SUITE_FILE
from pretraining.files import fsync_directory, temporary_path, write_atomically

MIN_ITEMS = 20  # fewer and a score is mostly noise


def stripped_lines(text: str) -> list[str]:
    """The text's non-blank lines, stripped: copies that differ in indentation or blank lines still match."""
    return [stripped for line in text.splitlines() if (stripped := line.strip())]


class TrainingText:
    """The texts of training splits, asked whether a text occurs in one of them as whole stripped lines."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.line_pairs: set[int] = set()
        documents = []
        for text in texts:
            lines = stripped_lines(text)
            self.line_pairs.update(map(hash, itertools.pairwise(lines)))
            documents.append("\n".join(lines))
        self.text = "\n" + "\n\0\n".join(documents) + "\n"

    def __contains__(self, text: object) -> bool:
        lines = stripped_lines(str(text))
        if any(hash(pair) not in self.line_pairs for pair in itertools.pairwise(lines)):
            return False  # most texts end here, without scanning the whole training text
        return "\n" + "\n".join(lines) + "\n" in self.text


def shard_manifest(directory: Path, option: str, fields: tuple[str, ...]) -> Manifest:
    """The checked manifest of `directory` (given as `option`), whose samples must have `fields`."""
    manifest = Manifest.load(directory, key=option)
    if manifest.fields != fields:
        wanted = "text shards (`pretrain-data build`)" if fields == TEXT_FIELDS else "pair shards (`--pairs`)"
        raise ConfigError(f"{option}={directory} holds samples of {', '.join(manifest.fields)}: pass {wanted}")
    return manifest


def python_files(manifest: Manifest, option: str) -> Iterator[tuple[str, str]]:
    """(source id, text) of the Python files in the validation split of `manifest`'s text shards."""
    reader = SampleReader(("json", TEXT_FIELDS[0]), policy="raise")
    for metadata, text in reader.all_texts(manifest.urls("validation")):
        source_id = json.loads(metadata).get("source_id")
        if not isinstance(source_id, str):
            raise ConfigError(
                f"{option}={manifest.directory}: its samples name no source file (json:source_id): build the "
                "shards with `pretrain-data build`"
            )
        if source_id.endswith(".py"):
            yield source_id, text


def file_functions(source_id: str, text: str) -> list[Function]:
    """The functions and methods of one file (none if it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    code = SourceBytes(text)
    found = (Function(source_id, name, code.segment(node)) for name, _, node in definitions(tree))
    return [function for function in found if function.code.startswith("def ")]


def held_out(functions: Iterable[Function], training: TrainingText) -> list[Function]:
    """`functions` but those also in training and the later copies of one another."""
    seen: set[str] = set()
    kept = []
    for function in functions:
        key = "\n".join(stripped_lines(function.code))
        if key not in seen and function.code not in training:
            kept.append(function)
        seen.add(key)
    return kept


def build_suite(
    data: Path, pairs: Path, out: Path, seed: int = 0, items: int = 500, max_bytes: int = 256
) -> dict[str, Any]:
    """Write the suite into `out` from `data`'s validation split (`pairs`: pair shards, whose training split is
    kept out too), at most `items` items a task, each within `max_bytes` bytes; return its suite.json."""
    manifest = shard_manifest(data, "--data", TEXT_FIELDS)
    pair_manifest = shard_manifest(pairs, "--pairs", PAIR_FIELDS)
    check_replaceable(out)
    files = list(python_files(manifest, "--data"))
    training = TrainingText(training_texts(manifest, pair_manifest))
    unseen = held_out((function for file in files for function in file_functions(*file)), training)
    tasks = [
        next_line_task(unseen, training, seed, items, max_bytes),
        function_name_task(unseen, training, seed, items, max_bytes),
        docstring_code_task(files, unseen, training, seed, items),
        heldout_text_task(unseen, training, seed, items, max_bytes),
    ]
    for task in tasks:
        if task.items < min(MIN_ITEMS, items):
            raise ConfigError(
                f"--data={data}: its validation split gives {task.items} items for {task.name}, fewer than "
                f"{MIN_ITEMS}: rebuild the shards with a larger --validation-fraction (`pretrain-data build`)"
            )
    source = {
        "data_dir": str(manifest.directory.resolve()),
        "data_version": manifest.version,
        "split": "validation",
        "pairs_dir": str(pair_manifest.directory.resolve()),
        "pairs_version": pair_manifest.version,
        "seed": seed,
    }
    suite = {"version": SUITE_VERSION, "source": source, "tasks": {task.name: task.entry() for task in tasks}}
    write_suite(out, tasks, suite)
    return suite


def training_texts(manifest: Manifest, pair_manifest: Manifest) -> Iterator[str]:
    """The texts of the text shards' training split, then the code of the pair shards'."""
    for (text,) in SampleReader(TEXT_FIELDS, policy="raise").all_texts(manifest.urls("train")):
        yield text
    for (code,) in SampleReader(PAIR_FIELDS[1:], policy="raise").all_texts(pair_manifest.urls("train")):
        yield code


def check_replaceable(out: Path) -> None:
    """Refuse an `out` that holds something other than a suite: replacing it would delete it."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / SUITE_FILE).is_file())):
        raise ConfigError(f"--out={out} holds no {SUITE_FILE} and is not empty: choose a new or empty directory")


def write_suite(out: Path, tasks: list[SuiteTask], suite: dict[str, Any]) -> None:
    """Write the tasks' files and suite.json (last) into a temporary directory beside `out`, then swap it in:
    a failure on the way leaves the suite that was there."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_path(out)
    try:
        for task in tasks:
            files = dict(task.files)
            if task.kind == "harness":
                files[f"{task.name}.yaml"] = harness_yaml(task.name, out / task.name / f"{task.name}.jsonl")
            for relative, data in files.items():
                path = staging / task.name / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(path, data)
        write_atomically(staging / SUITE_FILE, json.dumps(suite, indent=2).encode())
        swap_in(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def swap_in(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`, the suite there first renamed aside (and put back if the rename fails)."""
    previous = temporary_path(out)
    if out.exists():
        os.replace(out, previous)
    try:
        os.replace(staging, out)
    except BaseException:
        if previous.exists():
            os.replace(previous, out)
        raise
    fsync_directory(out.parent)
    shutil.rmtree(previous, ignore_errors=True)
