"""The coordinate check (`pretraining.extras.scaling`): under `mup` each layer's activation size stays flat with
width, and under `completep` with depth, while under `standard` they grow; for both backbones and both
optimizers; and `pretrain-scaling coordinates`, its files and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretraining.extras.scaling.cli import main
from pretraining.extras.scaling.coordinates import check, growth

WIDTHS = (32, 64, 128, 256)
DEPTHS = (2, 4, 8, 16)
LR = {"adamw": 1e-2, "muon": 1e-3}  # Muon's own 20x on the hidden matrices: its default 0.02
STEPS = 10


def growths(records: list, along: str, layers: tuple[str, ...]) -> dict[str, float]:
    return {layer: growth(records, layer, STEPS, along) for layer in layers}


def check_width(backbone: str, optimizer: str) -> None:
    standard, mup = (
        growths(
            check(backbone, name, optimizer, WIDTHS, steps=STEPS, lr=LR[optimizer], base_width=32),
            "width",
            ("layer 1", "last layer", "logits"),
        )
        for name in ("standard", "mup")
    )
    assert standard["last layer"] > 0.25 and standard["logits"] > 0.3, standard  # at least as width^0.25
    assert abs(mup["last layer"]) < 0.15 and abs(mup["layer 1"]) < 0.2, mup
    assert mup["logits"] < 0.05, mup  # the head's output does not grow (at init it shrinks as 1 / sqrt(width))


def check_depth(backbone: str, optimizer: str) -> None:
    shape = {"widths": (32,), "depths": DEPTHS, "base_width": 32, "base_depth": 2, "steps": STEPS, "lr": LR[optimizer]}
    standard, completep = (
        growths(check(backbone, name, optimizer, **shape), "depth", ("last layer", "logits"))  # type: ignore[arg-type]
        for name in ("standard", "completep")
    )
    assert standard["last layer"] > 0.25, standard
    assert abs(completep["last layer"]) < 0.1 and abs(completep["logits"]) < 0.1, completep


def test_mup_keeps_a_llama_with_adamw_flat_in_width() -> None:
    check_width("llama", "adamw")


def test_completep_keeps_gpt2_with_muon_flat_in_depth() -> None:
    check_depth("gpt2", "muon")


@pytest.mark.slow  # the other six of the eight backbone x optimizer x axis checks, a minute
@pytest.mark.parametrize(
    ("backbone", "optimizer", "along"),
    [
        ("llama", "muon", "width"),
        ("gpt2", "adamw", "width"),
        ("gpt2", "muon", "width"),
        ("llama", "adamw", "depth"),
        ("llama", "muon", "depth"),
        ("gpt2", "adamw", "depth"),
    ],
)
def test_every_backbone_and_optimizer(backbone: str, optimizer: str, along: str) -> None:
    (check_width if along == "width" else check_depth)(backbone, optimizer)


def test_the_command_prints_the_exponents_and_writes_records_and_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pretraining.extras.plots")  # the figure's
    pytest.importorskip("matplotlib")
    main(["coordinates", "--sizes", "32", "64", "128", "--steps", "3", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "growth exponent of each size against width at step 3" in printed
    assert printed.splitlines()[2].startswith("standard") and printed.splitlines()[3].startswith("mup")
    records = json.loads((tmp_path / "coordinates-width-llama-adamw.json").read_text())
    assert set(records) == {"standard", "mup"}
    assert {row["width"] for row in records["mup"]} == {32, 64, 128} and {row["step"] for row in records["mup"]} == {
        1,
        2,
        3,
    }
    assert (tmp_path / "coordinates-width-llama-adamw.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (["--sizes", "64"], "give two different widths or more"),
        (["--sizes", "64", "64"], "give two different widths or more"),
        (["--sizes", "30", "60"], "each width a multiple of 8"),
        (["--steps", "0"], "train at least one step at a positive rate"),
        (["--lr", "0"], "train at least one step at a positive rate"),
    ],
)
def test_settings_that_check_nothing_are_refused(tmp_path: Path, arguments: list[str], words: str) -> None:
    with pytest.raises(SystemExit, match=words):
        main(["coordinates", *arguments, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
