"""The linear probe: labels taken from the data, a file-disjoint split, the classifier against
controlled toy sets (and a negative control), the frozen features, and the callback in runs."""

from __future__ import annotations

import csv
import json
import random
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from conftest import packed_blocks, tiny_run
from pretraining.data.corpus import read_text_files
from pretraining.data.datamodule import ShardDataModule
from pretraining.data.manifest import PAIR_FIELDS, Manifest
from pretraining.data.pairs import docstring_pairs
from pretraining.data.shards import BuildSettings, build_shards
from pretraining.data.tokenizer import CLS_ID, PAD_ID, ByteTokenizer
from pretraining.errors import ConfigError
from pretraining.extras.probe.callback import LinearProbe, fit_linear_probe
from pretraining.extras.probe.labels import (
    LabelledExample,
    LabelledJsonl,
    PythonDefinitions,
    is_test,
    package_of,
    probe_set,
)
from pretraining.models.transformer import Transformer
from pretraining.objectives.causal_lm import CausalLM
from pretraining.objectives.contrastive import Contrastive
from pretraining.objectives.masked_lm import MaskedLM
from pretraining.train import train
from test_index import index

SOURCES = {
    "shapes/base.py": '''
        """Shapes."""

        def area(shape):
            """The area of a shape, in square units."""
            return shape.area()

        class Shape:
            """A closed figure in the plane."""

            def area(self):
                """The area of this shape."""
                raise NotImplementedError
        ''',
    "shapes/circle.py": """
        class Circle:
            def __init__(self, radius):
                self.radius = radius
        """,
    "colour.py": """
        def mix(a, b):
            return a + b
        """,
    "broken.py": "def (:\n",
    "README.txt": "def not_python(): pass\n",
}


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree") / "toy"
    for name, text in SOURCES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def build(root: Path, out: Path, pairs: bool = False) -> Manifest:
    """Every file in the train split (validation_fraction 0), as text or as docstring pairs."""
    documents = read_text_files(root)
    if pairs:
        documents = docstring_pairs(documents)
    fields = PAIR_FIELDS if pairs else ("txt",)
    build_shards(documents, out, [str(root)], BuildSettings(0.0), show_progress=False, fields=fields)
    return Manifest.load(out)


def test_definitions_of_text_shards_are_labelled_by_kind_and_package(source_tree: Path, tmp_path: Path) -> None:
    manifest = build(source_tree, tmp_path / "text")
    by_kind = PythonDefinitions("kind", split="train")
    examples = by_kind(manifest)
    assert {(e.group, e.label, e.text.splitlines()[0]) for e in examples} == {
        ("toy:shapes/base.py", "function", "def area(shape):"),
        ("toy:shapes/base.py", "class", "class Shape:"),
        ("toy:shapes/base.py", "method", "def area(self):"),
        ("toy:shapes/circle.py", "class", "class Circle:"),
        ("toy:shapes/circle.py", "method", "def __init__(self, radius):"),
        ("toy:colour.py", "function", "def mix(a, b):"),
    }
    method = next(e for e in examples if e.text.startswith("def __init__"))
    assert method.text == "def __init__(self, radius):\n    self.radius = radius"  # dedented, whole
    assert (by_kind.counts.python_files, by_kind.counts.unparsable_files) == (4, 1)  # broken.py skipped, counted
    assert "1 unparsable" in by_kind.describe()
    packages = {e.text.splitlines()[0]: e.label for e in PythonDefinitions("package", split="train")(manifest)}
    assert packages["class Circle:"] == "shapes" and packages["def mix(a, b):"] == "colour"


def test_definitions_of_pair_shards_are_their_passages(source_tree: Path, tmp_path: Path) -> None:
    manifest = build(source_tree, tmp_path / "pairs", pairs=True)
    examples = PythonDefinitions("kind", split="train")(manifest)
    # Documented definitions only (dunders left out), docstrings cut out of the passages.
    assert sorted((e.label, e.text) for e in examples) == [
        ("class", "class Shape:\n\n    def area(self):\n        raise NotImplementedError"),
        ("function", "def area(shape):\n    return shape.area()"),
        ("method", "def area(self):\n    raise NotImplementedError"),
    ]
    assert {e.label for e in PythonDefinitions("package", split="train")(manifest)} == {"shapes"}


def test_package_of_a_source_id() -> None:
    assert package_of("stdlib:email/mime/text.py") == "email"
    assert package_of("stdlib:typing.py") == "typing"


def many_examples(labels: int = 3, files: int = 40, per_file: int = 6) -> list[LabelledExample]:
    return [
        LabelledExample(f"text {f} {i}", f"label{(f + i) % labels}", f"file{f}")
        for f in range(files)
        for i in range(per_file)
    ]


def test_probe_set_keeps_files_on_one_side_and_spreads_over_labels() -> None:
    examples = many_examples()
    probe = probe_set(examples, max_classes=8, min_per_class=4, max_examples=90, test_fraction=0.3)
    train_files, test_files = {e.group for e in probe.train}, {e.group for e in probe.test}
    assert train_files and test_files and train_files.isdisjoint(test_files)
    assert all(is_test(e.group, 0.3) for e in probe.test)
    assert probe.classes == ["label0", "label1", "label2"]
    for label in probe.classes:  # 30 a label, 9 of them held out
        assert sum(e.label == label for e in probe.train) == 21
        assert sum(e.label == label for e in probe.test) == 9
    assert probe_set(list(reversed(examples)), 8, 4, 90, 0.3) == probe  # whatever the reading order


def test_probe_set_drops_repeated_texts_and_caps_the_labels() -> None:
    examples = many_examples(labels=5)
    repeated = [LabelledExample("same", "label0", f"file{f}") for f in range(40)]
    probe = probe_set(examples + repeated, max_classes=2, min_per_class=1, max_examples=1000)
    assert len(probe.classes) == 2
    assert sum(e.text == "same" for e in probe.train + probe.test) <= 1


def test_a_probe_set_of_one_label_is_refused_naming_the_keys() -> None:
    examples = [LabelledExample(f"text {i}", "only", f"file{i}") for i in range(50)]
    with pytest.raises(ConfigError, match=r"callbacks\.probe\.min_per_class.*callbacks\.probe\.labels"):
        probe_set(examples)
    with pytest.raises(ConfigError, match="min_per_class=500"):
        probe_set(many_examples(), min_per_class=500)


# --- the classifier ------------------------------------------------------------------------------------


def blobs(n: int, seed: int, separation: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian blobs in 16 dimensions (unit variance), their centres `separation` apart."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    centres = torch.eye(3, 16) * separation
    return centres[labels] + torch.randn(n, 16, generator=generator), labels


def test_the_linear_probe_separates_blobs_and_stays_at_chance_on_random_labels() -> None:
    train_x, train_y = blobs(150, 0, separation=6.0)
    test_x, test_y = blobs(300, 1, separation=6.0)
    result = fit_linear_probe(train_x, train_y, test_x, test_y)
    assert result.accuracy > 0.95 and result.majority == pytest.approx(1 / 3)
    shuffled = torch.randint(0, 3, (150,), generator=torch.Generator().manual_seed(2))
    control = fit_linear_probe(train_x, shuffled, test_x, test_y)  # labels unrelated to the features
    assert control.accuracy < 0.45
    # Deterministic, and usable inside inference mode (features extracted there are inference tensors).
    with torch.inference_mode():
        again = fit_linear_probe(train_x.clone(), train_y, test_x.clone(), test_y)
    assert again == result


def test_standardising_makes_the_probe_blind_to_feature_scale() -> None:
    train_x, train_y = blobs(90, 0, separation=2.0)
    test_x, test_y = blobs(90, 1, separation=2.0)
    scale = torch.logspace(-3, 3, 16)
    plain = fit_linear_probe(train_x, train_y, test_x, test_y)
    scaled = fit_linear_probe(train_x * scale, train_y, test_x * scale, test_y)
    assert scaled.accuracy == pytest.approx(plain.accuracy)


# --- features --------------------------------------------------------------------------------------------


def objectives() -> list[CausalLM | MaskedLM | Contrastive]:
    def backbone(causal: bool) -> Transformer:
        return Transformer(vocab_size=260, max_seq_len=32, d_model=32, n_layer=1, n_head=2, dropout=0.2, causal=causal)

    optimizer = partial(torch.optim.AdamW, lr=1e-3)
    return [
        CausalLM(backbone(True), optimizer=optimizer),
        MaskedLM(backbone(False), optimizer=optimizer),
        Contrastive(backbone(False), optimizer=optimizer),
    ]


@pytest.mark.parametrize("objective", objectives(), ids=lambda o: type(o).__name__)
def test_features_leave_the_model_unchanged_and_ignore_padding(objective) -> None:
    torch.manual_seed(0)
    row = [CLS_ID, *torch.randint(4, 260, (9,)).tolist()]
    longer = [CLS_ID, *torch.randint(4, 260, (20,)).tolist()]
    tokens = torch.tensor([row + [PAD_ID] * 11, longer])
    attend = tokens != PAD_ID
    before = {name: value.clone() for name, value in objective.state_dict().items()}
    for mode in (True, False):
        objective.train(mode)
        features = objective.features(tokens, attend)
        assert objective.training is mode and not features.requires_grad
    assert features.dtype == torch.float32 and features.shape[0] == 2
    for name, value in objective.state_dict().items():
        assert torch.equal(value, before[name]), name
    objective.train()
    torch.testing.assert_close(objective.features(tokens, attend), features)  # eval mode: no dropout
    alone = objective.features(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.bool))
    torch.testing.assert_close(alone[0], features[0], rtol=1e-5, atol=1e-6)  # padding changes nothing
    if isinstance(objective, Contrastive):  # the passage embedding it trains
        objective.eval()
        torch.testing.assert_close(features, objective.encode(tokens, "passage"))


# --- the callback ------------------------------------------------------------------------------------------


def toy_labels(path: Path, count: int = 120, seed: int = 0) -> Path:
    """Two classes a random model can tell apart: texts over the letters a-d, and over w-z."""
    rng = random.Random(seed)
    with path.open("w") as file:
        for i in range(count):
            letters = "abcd" if i % 2 else "wxyz"
            text = "".join(rng.choice(letters) for _ in range(rng.randrange(8, 40)))
            file.write(json.dumps({"text": text, "label": letters, "group": f"g{i // 2}"}) + "\n")
    return path


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open() as file:
        return list(csv.DictReader(file))


def test_the_probe_callback_logs_accuracy_above_chance_on_a_toy_set(tmp_path: Path, shard_dir: Path) -> None:
    tokenizer = ByteTokenizer()
    datamodule = ShardDataModule(
        str(shard_dir), tokenizer, format=packed_blocks(32), global_batch_size=2, streams=1, num_workers=0, val_size=2
    )
    torch.manual_seed(0)
    backbone = Transformer(tokenizer.vocab_size, max_seq_len=32, d_model=32, n_layer=1, n_head=2)
    model = CausalLM(backbone, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    probe = LinearProbe(labels=str(toy_labels(tmp_path / "toy.jsonl")), min_per_class=4, max_examples=100)
    logger = CSVLogger(tmp_path, name="csv", version="")
    trainer = Trainer(
        accelerator="cpu", logger=logger, callbacks=[probe], enable_progress_bar=False, enable_checkpointing=False
    )
    metrics = trainer.validate(model, datamodule=datamodule)[0]
    assert probe.latest is not None
    assert probe.latest.accuracy > probe.latest.majority + 0.3
    assert metrics["probe/accuracy"] == pytest.approx(probe.latest.accuracy)
    logger.save()
    [row] = metric_rows(tmp_path)
    assert row["step"] == "0" and float(row["probe/accuracy"]) == pytest.approx(probe.latest.accuracy)
    assert float(row["probe/majority"]) == pytest.approx(probe.latest.majority)
    assert row["val/loss"]  # the same row as the validation metrics


def test_a_training_run_logs_the_probe_at_every_validation(compose_train, tmp_path: Path) -> None:
    overrides = [*tiny_run("clm_tiny"), "callbacks=[default,probe]"]
    metrics = train(compose_train(*overrides, "callbacks.probe.min_per_class=2", tiny=False))
    rows = [row for row in metric_rows(tmp_path) if row.get("probe/accuracy")]
    assert [int(row["step"]) for row in rows] == [0, 6, 12]  # before training, after steps 6 and 12
    assert all(row["val/loss"] for row in rows)  # in the rows of the validation metrics
    for row in rows:
        assert 0.0 <= float(row["probe/accuracy"]) <= 1.0 and 0.0 < float(row["probe/majority"]) < 1.0
    assert metrics["probe/accuracy"] == pytest.approx(float(rows[-1]["probe/accuracy"]))


def test_a_probe_set_the_data_cannot_give_stops_the_run_before_training(
    compose_train, tmp_path: Path, small_shards: Path
) -> None:
    overrides = [*tiny_run("clm_tiny"), "callbacks=[default,probe]"]
    cfg = compose_train(*overrides, f"data.dir={small_shards}", tiny=False)  # no Python files in these shards
    with pytest.raises(ConfigError, match=r"~callbacks\.probe"):
        train(cfg)
    assert not list(tmp_path.glob("checkpoints/*.ckpt"))


@pytest.mark.parametrize("line", [b'{"text": "a", "label": ', b'{"text": "\xff", "label": "x"}', b'["a", "x"]'])
def test_a_bad_line_of_a_labelled_jsonl_is_refused_naming_the_line(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "labels.jsonl"
    path.write_bytes(b'{"text": "fine", "label": "x"}\n' + line + b"\n")
    with pytest.raises(ConfigError, match=r"labels.jsonl:2 is not a JSON object with a string 'text' and a 'label'"):
        LabelledJsonl(str(path))(None)  # type: ignore[arg-type]  # a jsonl source reads no manifest


def test_the_probe_labels_reindexed_built_shards_as_built(pair_dir: Path, tmp_path: Path) -> None:
    index(f"{pair_dir}/train-*.tar", "--validation", f"{pair_dir}/validation-*.tar", "--out", str(tmp_path / "i"))
    reindexed, built = Manifest.load(tmp_path / "i"), Manifest.load(pair_dir)
    assert reindexed.fields != built.fields and reindexed.version != built.version
    assert PythonDefinitions("kind")(reindexed) == PythonDefinitions("kind")(built) != []
