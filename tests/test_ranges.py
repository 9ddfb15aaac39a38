"""Every float range refuses NaN, and infinity unless it allows it: found by walking every annotated key of the
shipped configs (each node's `_target_` signature, as the schema checks it), so a range added later is covered."""

from __future__ import annotations

import math
import re
import types
from collections.abc import Iterator
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from hydra import compose, initialize_config_dir

from pretraining.config import CONFIG_DIR
from pretraining.errors import ConfigError
from pretraining.ranges import Range, checked_ranges, item_annotation
from pretraining.schema import check_value, locate, plain, signature
from pretraining.settings import EvalSettings, TrainSettings

NOT_FINITE = (math.nan, math.inf, -math.inf)
# Every preset of the groups that choose classes, as tests/test_schema.py composes them.
CONFIGS = [
    ("train", TrainSettings, [f"{group}={path.stem}"])
    for group in ("experiment", "model", "callbacks", "debug")
    for path in sorted((CONFIG_DIR / group).glob("*.yaml"))
] + [("eval", EvalSettings, ["ckpt_path=x.ckpt"])]


def annotated_keys(values: dict[str, Any], target: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(key, annotation) of every parameter of `target` and of the nodes below it (`_target_` nodes and mappings
    of them: callbacks, loggers)."""
    for name, annotation in signature(target)[0].items():
        full_key = f"{key}.{name}" if key else name
        yield full_key, annotation
        value = values.get(name)
        nodes = {name: value} if isinstance(value, dict) and "_target_" in value else {}
        if isinstance(value, dict) and not nodes:
            nodes = {f"{name}.{k}": v for k, v in value.items() if isinstance(v, dict) and "_target_" in v}
        for node_key, node in nodes.items():
            node_key = f"{key}.{node_key}" if key else node_key
            yield from annotated_keys(node, locate(node["_target_"], node_key), node_key)


def float_ranges(annotation: Any) -> list[Range]:
    """The ranges a float value of `annotation` meets (not those of its items)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        own = [meta for meta in args[1:] if isinstance(meta, Range)] if args[0] is float else []
        return own + float_ranges(args[0])
    if origin in (Union, types.UnionType):
        return [r for arg in args for r in float_ranges(arg)]
    return []


def ranged_floats(key: str, annotation: Any) -> Iterator[tuple[str, Any, list[Range]]]:
    """(key, annotation, ranges) of a float-ranged key, or of its items (`model.optimizer.betas[1]`)."""
    if ranges := float_ranges(annotation):
        yield key, annotation, ranges
    if get_origin(annotation) is tuple:
        for index in range(len(get_args(annotation))):
            yield from ranged_floats(f"{key}[{index}]", item_annotation(annotation, index))


def every_ranged_float() -> dict[str, tuple[Any, list[Range]]]:
    found = {}
    for config, settings, overrides in CONFIGS:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            values = plain(compose(config, overrides=overrides), skip=("hydra",))
        for key, annotation in annotated_keys(values, settings):
            for item_key, item_annotation_, ranges in ranged_floats(key, annotation):
                found[item_key] = (item_annotation_, ranges)
    return found


RANGED = every_ranged_float()


def test_the_walk_finds_the_ranges_the_issue_named() -> None:
    named = {"model.optimizer.lr", "model.optimizer.muon_lr", "model.min_lr_ratio", "model.backbone.norm_eps"}
    assert named | {"model.backbone.rope_theta", "model.optimizer.betas[1]", "temperature"} <= set(RANGED)


@pytest.mark.parametrize("key", sorted(RANGED))
def test_every_float_range_refuses_nan_and_infinity(key: str) -> None:
    annotation, _ = RANGED[key]
    for value in NOT_FINITE:
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}={value} must be a finite number"):
            check_value(value, annotation, key)


def test_a_range_refuses_nan_and_infinity() -> None:
    assert not Range(gt=0).admits(math.nan) and not Range(gt=0).admits(math.inf)
    assert not Range(ge=0, le=1).admits(math.nan) and not Range(le=0).admits(-math.inf)
    assert not Range().admits(math.inf) and Range().admits(1e308)
    assert Range(ge=1).admits(10**400)  # an int is finite, however large
    assert Range(gt=0).problem(math.nan) == "must be a finite number > 0"


def test_python_callers_get_the_same_refusal() -> None:
    @checked_ranges("model")
    def build(lr: Annotated[float, Range(gt=0)]) -> float:
        return lr

    assert build(0.1) == 0.1
    with pytest.raises(ConfigError, match=r"^model\.lr=nan must be a finite number > 0: set model\.lr"):
        build(math.nan)
