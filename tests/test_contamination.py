"""Decontamination: a validation document made mostly of training text is left out of the build, and named."""

from __future__ import annotations

import json
import random

import pytest

from pretraining.cli import data as cli_main
from pretraining.data.contamination import TrainingNgrams
from pretraining.data.corpus import Document
from pretraining.data.manifest import MANIFEST, Manifest
from pretraining.data.reader import read_shard
from pretraining.data.shards import BuildSettings, build_shards


def words(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [f"w{rng.randrange(10_000)}" for _ in range(count)]


def test_the_share_counts_distinct_ngrams_found_in_training():
    training = TrainingNgrams()
    training.add([" ".join(f"a{i}" for i in range(9))])  # a0 ... a8: two 8-grams
    probe = " ".join(f"a{i}" for i in range(10))  # a0 ... a9: three, the first two in training
    assert training.share([probe]) == pytest.approx(2 / 3)
    assert training.share(["a0 a1 a2"]) == 0.0  # fewer than 8 words: no 8-grams, never contaminated
    assert training.share(["a0 a1 a2 a3", "a4 a5 a6 a7"]) == 0.0  # no 8-gram spans two texts (a query, a passage)
    assert training.share(["a0 a1 a2, a3 a4 a5 a6 a7"]) == 0.0  # a mark is a word of its own: no 8-gram there
    training.add(["x = f(a0, a1)"])  # x = f ( a0 , a1 ): one 8-gram
    assert training.share(["y; x = f(a0, a1)"]) == pytest.approx(1 / 3)  # the last of y ; x = f ( a0 , a1 )'s 3
    assert TrainingNgrams().share([probe]) == 0.0  # nothing added yet


def validation_ids(directory) -> list[str]:
    urls = Manifest.load(directory).urls("validation")
    return [json.loads(sample["json"])["source_id"] for url in urls for sample in read_shard(url)]


@pytest.mark.parametrize("threshold", [0.7, None])
def test_a_near_copy_of_a_training_document_is_left_out_of_validation(tmp_path, threshold):
    original = words(0, 400)
    near_copy = original[:300] + words(1, 40) + original[300:]  # 40 words inserted: most 8-grams still shared
    half = original[:200] + words(2, 200)  # about half of its 8-grams are training's
    documents = [
        Document("train:a", {"txt": " ".join(original)}),
        Document("train:b", {"txt": " ".join(words(3, 400))}),
    ]
    validation = [
        Document(f"val:{name}", {"txt": " ".join(text)})
        for name, text in (("near_copy", near_copy), ("half", half), ("fresh", words(4, 400)))
    ]
    settings = BuildSettings(validation_sources=["val"], decontaminate=threshold)
    manifest = build_shards(documents, tmp_path / "out", ["train"], settings, False, validation_documents=validation)
    if threshold is None:
        assert validation_ids(tmp_path / "out") == ["val:near_copy", "val:half", "val:fresh"]
        assert manifest["decontamination"] == {"rule": "none: every validation document is kept", "dropped": []}
    else:
        assert validation_ids(tmp_path / "out") == ["val:half", "val:fresh"]
        assert manifest["decontamination"]["dropped"] == ["val:near_copy"]
        assert "at least 0.7 of its distinct 8-grams" in manifest["decontamination"]["rule"]
    assert manifest["splits"]["validation"]["documents"] == (3 if threshold is None else 2)
    assert manifest["splits"]["train"]["documents"] == 2  # training keeps every document


def test_the_cli_decontaminates_by_default_and_says_so(tmp_path, capsys):
    corpus, held_out = tmp_path / "corpus", tmp_path / "held_out"
    corpus.mkdir()
    held_out.mkdir()
    (corpus / "table.txt").write_text("\n".join(" ".join(words(n, 12)) for n in range(50)))
    (corpus / "other.txt").write_text(" ".join(words(99, 300)))
    # 45 of the table's rows and 5 of its own: about 0.9 of its 8-grams are the table's
    (held_out / "regenerated.txt").write_text(
        "\n".join(" ".join(words(n, 12)) for n in [*range(5, 50), *range(200, 205)])
    )
    (held_out / "fresh.txt").write_text(" ".join(words(100, 300)))
    runs = {"default": ([], 1), "0.95": (["--decontaminate", "0.95"], 2), "off": (["--no-decontaminate"], 2)}
    for name, (flags, kept) in runs.items():
        out = tmp_path / name
        cli_main(["build", "--source", str(corpus), "--validation-source", str(held_out), "--out", str(out), *flags])
        manifest = json.loads((out / MANIFEST).read_text())
        assert manifest["splits"]["validation"]["documents"] == kept
        printed = capsys.readouterr().out
        summary = {
            "default": "1 validation documents mostly in the training split",
            "0.95": "0 validation documents mostly in the training split",
            "off": "no validation document for being training text (--no-decontaminate)",
        }
        assert summary[name] in printed
        # Fewer than 8 validation documents are warned of, and the warning says where the others went.
        left_out = "has 1 documents (and 1 left out as mostly training text"
        assert (left_out in printed and "or keep more with a higher --decontaminate" in printed) == (name == "default")


@pytest.mark.parametrize(("value", "shown"), [("0", "0.0"), ("1.5", "1.5"), ("-0.2", "-0.2")])
def test_a_share_outside_zero_to_one_is_refused_before_any_work(tmp_path, value, shown):
    with pytest.raises(SystemExit, match=rf"--decontaminate {shown} must be in \(0, 1\].*--no-decontaminate"):
        cli_main(["build", "--source", "stdlib", "--decontaminate", value, "--out", str(tmp_path / "out"), "--quiet"])
    assert not (tmp_path / "out").exists()
