"""scripts/bench/bench_recipes.py: a run's curve read from its CSV log, and where one curve reaches another's end."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "scripts" / "bench" / "bench_recipes.py"


@pytest.fixture(scope="module")
def recipes():
    spec = importlib.util.spec_from_file_location("bench_recipes", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_recipes"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_log(path: Path) -> Path:
    rows = [
        "step,val/bpb,perf/step_time",
        "0,8.0,",  # the untrained model
        "9,,0.5",  # steps 1-9 (logged at step 9 and 19, as Lightning writes at index 9, 19)
        "10,3.5,",
        "19,,0.25",
        "20,3.0,",
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_curve_holds_its_validations_and_the_training_time_to_each_logged_step(recipes, tmp_path: Path) -> None:
    curve = recipes.read_curve(write_log(tmp_path / "metrics.csv"), "val/bpb", wall=60.0)
    assert curve.metric == {10: 3.5, 20: 3.0} and curve.final == 3.0
    assert curve.train_seconds == {9: 4.5, 19: 7.0}
    assert curve.seconds_to(10) == 4.5 and curve.seconds_to(20) == 7.0


def test_the_first_validated_step_at_or_past_a_target(recipes, tmp_path: Path) -> None:
    curve = recipes.read_curve(write_log(tmp_path / "metrics.csv"), "val/bpb", wall=60.0)
    assert recipes.reached(curve, 3.5, higher_is_better=False) == 10
    assert recipes.reached(curve, 3.2, higher_is_better=False) == 20
    assert recipes.reached(curve, 2.0, higher_is_better=False) is None
    assert recipes.reached(curve, 3.4, higher_is_better=True) == 10
