"""Labelled examples for probes (`pretraining.extras.probe.callback.LinearProbe`), taken from the data itself.

A probe set is a list of `LabelledExample`s: a text, its label, and its group (the file it comes
from), which decides the side of the probe's train/test split, so a file never has examples on
both. A label source is any callable that takes the run's shard `Manifest` and returns labelled
examples (`label_source` turns a config value into one); two are here, and another corpus needs
a `.jsonl` file or one more source:

- `PythonDefinitions`: every function, class and method defined in the Python files of the
  validation split (held out from training), labelled by `package`, the top-level package or
  module of its file (`stdlib:email/_parseaddr.py` -> `email`, `stdlib:typing.py` -> `typing`),
  or by `kind` (`function`, `class` or `method`). Text shards hold whole files, parsed with `ast`
  (files that do not parse are skipped and counted); pair shards hold one definition per sample,
  the passage (its code, docstrings cut out), with its kind in the sample's metadata.
- `SampleField`: the label each validation sample carries in a field of its own (`field:cls`, WebDataset's
  class member; `field:json:label`, a key of its JSON member), for shards that hold labels.
- `LabelledJsonl`: a `.jsonl` file of `{"text": ..., "label": ..., "group": ...}` (the group is
  optional: without it every line is a group of its own).

`probe_set` then splits the examples by a stable hash of their group, keeps the most frequent
labels that have enough examples on both sides, and at most a given number of examples, spread
evenly over the labels, so that chance is close to one over the number of labels.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from pretraining.data.corpus import jsonl_records
from pretraining.data.manifest import PAIR_FIELDS, TEXT_FIELDS, Manifest
from pretraining.data.pairs import SourceBytes, definitions
from pretraining.data.reader import SampleReader
from pretraining.data.stream import stable_hash
from pretraining.errors import ConfigError

# Where the probe callback sits in configs/callbacks/probe.yaml: errors name its keys.
KEY = "callbacks.probe"


@dataclass(frozen=True)
class LabelledExample:
    text: str
    label: str
    group: str  # examples of one group (one file) stay on one side of the train/test split


class LabelSource(Protocol):
    """Where a probe's labelled examples come from."""

    def __call__(self, manifest: Manifest) -> list[LabelledExample]: ...

    def describe(self) -> str:
        """What was read, in a few words, for the log (after a call)."""
        ...


def package_of(source_id: str) -> str:
    """The top-level package or module of a file's source id: `stdlib:email/utils.py` -> `email`."""
    first = PurePosixPath(source_id.split(":", 1)[-1]).parts[0]
    return first.removesuffix(".py")


@dataclass
class DefinitionCounts:
    samples: int = 0
    python_files: int = 0
    unparsable_files: int = 0  # Python 2 samples, deliberate syntax errors in tests, ...
    definitions: int = 0


class PythonDefinitions:
    """The definitions of the Python files of a split, labelled by `package` or `kind` (see module doc)."""

    LABELS = ("package", "kind")

    def __init__(self, label: str = "package", split: str = "validation") -> None:
        if label not in self.LABELS:
            raise ConfigError(
                f"{KEY}.labels={label!r} must be one of {', '.join(self.LABELS)}, field:<a sample field>, or a "
                ".jsonl file"
            )
        self.label, self.split = label, split
        self.counts = DefinitionCounts()

    def __call__(self, manifest: Manifest) -> list[LabelledExample]:
        self.counts = DefinitionCounts()
        pairs = set(PAIR_FIELDS) <= set(manifest.fields)
        if manifest.field_counts and "json:source_id" not in manifest.fields:  # indexed, not built here
            raise self.unlabelled(manifest)
        # Through the reader training uses: the sample's metadata, and its last field (a text's whole file,
        # a pair's passage: code, as the probe's texts are).
        reader = SampleReader(("json", PAIR_FIELDS[1] if pairs else TEXT_FIELDS[0]))
        examples: list[LabelledExample] = []
        for metadata, text in reader.all_texts(manifest.urls(self.split)):
            self.counts.samples += 1
            meta = json.loads(metadata)
            source_id = meta.get("source_id") if isinstance(meta, dict) else None
            if not isinstance(source_id, str):
                raise self.unlabelled(manifest)
            if not source_id.endswith(".py"):
                continue
            if pairs:
                kind = meta.get("kind")
                if kind is None and self.label == "kind":
                    continue  # pairs from jsonl carry no kind
                examples.append(LabelledExample(text, self._label(source_id, kind), source_id))
                self.counts.definitions += 1
            else:
                examples += self._file_definitions(source_id, text)
        return examples

    def unlabelled(self, manifest: Manifest) -> ConfigError:
        return ConfigError(
            f"{KEY}.labels={self.label} labels the Python files named in the metadata of shards built by "
            f"`pretrain-data build`, and the samples of {manifest.directory} name none: set {KEY}.labels to a "
            f".jsonl of labelled texts for this corpus, or turn the probe off with ~{KEY}"
        )

    def _file_definitions(self, source_id: str, source: str) -> list[LabelledExample]:
        self.counts.python_files += 1
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            self.counts.unparsable_files += 1
            return []
        code = SourceBytes(source)
        examples = []
        for _, kind, node in definitions(tree):
            text = code.segment(node)
            examples.append(LabelledExample(text, self._label(source_id, kind), source_id))
        self.counts.definitions += len(examples)
        return examples

    def _label(self, source_id: str, kind: str | None) -> str:
        return package_of(source_id) if self.label == "package" else str(kind)

    def describe(self) -> str:
        counts = self.counts
        files = f" in {counts.python_files} Python files ({counts.unparsable_files} unparsable, skipped)"
        return (
            f"{counts.definitions} definitions{files if counts.python_files else ''} of {counts.samples} "
            f"{self.split} samples, labelled by {self.label}"
        )


class SampleField:
    """Each validation sample's text (a text, or a pair's passage) labelled by its `field` (see
    `pretraining.data.reader.field_text`); every sample is a group of its own. A sample without the field
    is skipped, and counted."""

    def __init__(self, field: str, split: str = "validation") -> None:
        self.field, self.split = field, split
        self.reader = SampleReader(())

    def __call__(self, manifest: Manifest) -> list[LabelledExample]:
        if self.field.partition(":")[0] not in {name.partition(":")[0] for name in manifest.fields}:
            manifest.require_fields([(f"{KEY}.labels", self.field)], "name a field the samples carry")
        text = PAIR_FIELDS[1] if set(PAIR_FIELDS) <= set(manifest.fields) else TEXT_FIELDS[0]
        self.reader = SampleReader((text, self.field))
        examples = [
            LabelledExample(text, label, f"sample {number}")
            for number, (text, label) in enumerate(self.reader.all_texts(manifest.urls(self.split)))
        ]
        return examples

    def describe(self) -> str:
        return f"{self.reader.read} {self.split} samples labelled by their {self.field} ({self.reader.skipped} without)"


class LabelledJsonl:
    """Labelled examples from a `.jsonl` file: one `{"text": ..., "label": ..., "group": ...}` a line."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{KEY}.labels={path} is not a file: point it at a .jsonl of labelled texts")
        self.lines = 0

    def __call__(self, manifest: Manifest) -> list[LabelledExample]:
        examples = []
        for number, record in jsonl_records(self.path):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str) or "label" not in record:
                raise ConfigError(
                    f"{self.path}:{number} is not a JSON object with a string 'text' and a 'label': fix the line"
                )
            group = str(record.get("group", f"line {number}"))
            examples.append(LabelledExample(record["text"], str(record["label"]), group))
        self.lines = len(examples)
        return examples

    def describe(self) -> str:
        return f"{self.lines} labelled texts from {self.path}"


def label_source(labels: str | LabelSource) -> LabelSource:
    """The source a config names: `field:<field>` (`SampleField`), `package` or `kind` (`PythonDefinitions`),
    a `.jsonl` file (`LabelledJsonl`), or a source itself (a `_target_` node, instantiated by Hydra)."""
    if not isinstance(labels, str):
        return labels
    if labels.startswith("field:"):
        return SampleField(labels.removeprefix("field:"))
    if labels.endswith(".jsonl"):
        return LabelledJsonl(labels)
    return PythonDefinitions(labels)


@dataclass(frozen=True)
class ProbeSet:
    """The probe's examples, split by group; `classes` lists the labels, most frequent first."""

    train: list[LabelledExample]
    test: list[LabelledExample]
    classes: list[str]
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # label -> (train, test) examples kept


def is_test(group: str, test_fraction: float) -> bool:
    """The side of the probe split a group falls on: a pure function of the group's name."""
    return stable_hash("probe", group) / 2**63 < test_fraction


def probe_set(
    examples: Iterable[LabelledExample],
    max_classes: int = 8,
    min_per_class: int = 8,
    max_examples: int = 256,
    test_fraction: float = 0.3,
) -> ProbeSet:
    """The probe's train and test examples: texts repeated verbatim dropped (the first kept); the
    `max_classes` most frequent labels among those with at least `min_per_class` examples on each side
    of the split by group; then at most `max_examples / classes` examples of each label, chosen by a
    hash of their text and shared between the sides in the `test_fraction` proportion. Raises a
    `ConfigError` naming the keys to change when fewer than two labels qualify."""
    seen: set[str] = set()
    sides: dict[bool, dict[str, list[LabelledExample]]] = {False: {}, True: {}}
    for example in examples:
        if example.text.strip() and example.text not in seen:
            seen.add(example.text)
            sides[is_test(example.group, test_fraction)].setdefault(example.label, []).append(example)
    totals = Counter({label: len(items) for side in sides.values() for label, items in side.items()})
    qualified = [
        label
        for label, _ in sorted(totals.items(), key=lambda item: (-item[1], item[0]))
        if all(len(side.get(label, [])) >= min_per_class for side in sides.values())
    ][:max_classes]
    if len(qualified) < 2:
        per_side = {label: (len(sides[False].get(label, [])), len(sides[True].get(label, []))) for label in totals}
        raise ConfigError(
            f"the probe set has {len(qualified)} label(s) with at least {KEY}.min_per_class={min_per_class} "
            f"examples on each side of the split (label: (train, test) examples: "
            f"{dict(sorted(per_side.items(), key=lambda item: -sum(item[1]))[:10]) or 'none'}); it needs 2: "
            f"lower {KEY}.min_per_class, set {KEY}.labels (kind, or a labelled .jsonl for this corpus), "
            f"or turn the probe off with ~{KEY}"
        )
    quota = max_examples // len(qualified)
    test_quota = max(1, round(quota * test_fraction))
    chosen: dict[bool, list[LabelledExample]] = {False: [], True: []}
    counts = {}
    for label in qualified:
        for test, limit in ((False, quota - test_quota), (True, test_quota)):
            items = sorted(sides[test][label], key=lambda example: stable_hash("probe", example.text))
            chosen[test] += items[:limit]
        counts[label] = (min(len(sides[False][label]), quota - test_quota), min(len(sides[True][label]), test_quota))
    return ProbeSet(chosen[False], chosen[True], qualified, counts)
