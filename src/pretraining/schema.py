"""The config schema, checked at startup before anything is built or read. Each node with a `_target_` is checked
against its target's signature: unknown keys (naming the closest), annotated types, and `Range` metadata
(`EXTRA_ANNOTATIONS` for classes this package does not own), so a class of your own is checked once it has type
hints. train.yaml's and eval.yaml's top-level keys: `TrainSettings`, `EvalSettings` (`pretraining.settings`);
relations between groups: `pretraining.run.check_config`."""

from __future__ import annotations

import difflib
import inspect
import pydoc
import types
from collections import abc
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretraining.errors import ConfigError
from pretraining.ranges import Range, describe, fits, item_annotation, mapping, out_of_range, range_problem, type_hints

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


Beta = Annotated[float, Range(ge=0, lt=1)]
# Lightning's counts of batches or steps that may be a fraction (of an epoch, of the batches).
Batches = Annotated[int, Range(ge=0)] | Annotated[float, Range(ge=0, le=1)]
# Ranges of parameters of classes we do not own, by defining module: named, not imported, so `--cfg job` loads no torch.
EXTRA_ANNOTATIONS: dict[str, dict[str, Any]] = {
    "torch.optim.adamw.AdamW": {
        "lr": Annotated[float, Range(gt=0)],
        "betas": tuple[Beta, Beta],
        "eps": Annotated[float, Range(gt=0)],
        "weight_decay": Annotated[float, Range(ge=0)],
    },
    # Every Trainer number configs/ set (devices: `launch.check_devices`).
    "lightning.pytorch.trainer.trainer.Trainer": {
        "num_nodes": Annotated[int, Range(ge=1)],
        "max_steps": Annotated[int, Range(ge=1, why="the LR schedule and the infinite stream need it")],
        "max_epochs": Literal[-1] | Annotated[int, Range(ge=1)] | None,
        "val_check_interval": Annotated[int, Range(ge=1)] | None,  # steps (build_trainer): no epochs
        "check_val_every_n_epoch": Annotated[int, Range(ge=1)] | None,
        "num_sanity_val_steps": Annotated[int, Range(ge=-1)] | None,
        "log_every_n_steps": Annotated[int, Range(ge=1)],
        "gradient_clip_val": Annotated[float, Range(ge=0)] | None,
        "fast_dev_run": bool | Annotated[int, Range(ge=0)],
        "limit_val_batches": Batches | None,
        "overfit_batches": Batches,
        "accumulate_grad_batches": Literal[1],  # derived by run.build_trainer (check_config refuses another first)
    },
}


class Unset:
    """A value left `???` (set later by the code, or reported by OmegaConf when read), or an interpolation only a
    Hydra run resolves (`${hydra:runtime.output_dir}`)."""


UNSET = Unset()


def check_schema(cfg: DictConfig, settings: type, name: str) -> None:
    """Raise a ConfigError naming key, value and fix for the first value not fitting `settings` (a dataclass, for
    config `name`'s top-level keys) or the signature of its node's `_target_`. The values written are checked
    before those interpolating them, so a bad value is named by the key it was set at (model.backbone.max_seq_len),
    not by one copying it (data.format.block_size: ${model.backbone.max_seq_len})."""
    for interpolations in (False, True):
        check_node(plain(cfg, skip=("hydra",), interpolations=interpolations), settings, "", f"a key of {name}")


def plain(node: Any, skip: tuple[str, ...] = (), interpolations: bool = True) -> Any:
    """`node` as dicts, lists and resolved values, with UNSET where a value cannot be known yet (and, without
    `interpolations`, where it is an interpolation)."""
    if isinstance(node, DictConfig):
        return {str(key): plain_item(node, key, interpolations) for key in node if str(key) not in skip}
    if isinstance(node, ListConfig):
        return [plain_item(node, index, interpolations) for index in range(len(node))]
    return node


def plain_item(node: DictConfig | ListConfig, key: Any, interpolations: bool) -> Any:
    try:
        if OmegaConf.is_missing(node, key) or (not interpolations and OmegaConf.is_interpolation(node, key)):
            return UNSET
        return plain(node[key], interpolations=interpolations)
    except OmegaConfBaseException:  # an interpolation only a Hydra run resolves, or a `???` one
        return UNSET


def check_node(values: dict[str, Any], target: Callable[..., Any], key: str, what: str) -> None:
    """Check the keys and values of a node against the signature of `target` (`what` the keys are)."""
    parameters, open_ended = signature(target)
    for name, value in values.items():
        if name in HYDRA_KEYS:
            continue
        full_key = f"{key}.{name}" if key else name
        if name not in parameters and not open_ended:
            raise unknown_key(full_key, value, what, list(parameters))
        check_value(value, parameters.get(name, Any), full_key)


def check_value(value: Any, annotation: Any, key: str) -> None:
    """Check one value: a `_target_` node against its target, anything else against `annotation`."""
    if value is UNSET:
        return
    if isinstance(value, dict) and value.get("_target_") is UNSET:  # interpolated: checked in the second pass
        return
    if isinstance(value, dict) and "_target_" in value:
        target = locate(value["_target_"], key)
        if not value.get("_partial_") and not builds(target, annotation):
            raise ConfigError(
                f"{key}._target_={value['_target_']} does not make {describe(annotation)}: name a class that does"
            )
        check_node(value, target, key, f"a parameter of {value['_target_']}")
        return
    if not fits(value, annotation):
        raise ConfigError(f"{key}={value!r} is not {describe(annotation)}: change {key} to such a value")
    problem = range_problem(value, annotation)
    if problem:
        raise out_of_range(key, value, problem)
    if isinstance(value, dict):
        for name, item in value.items():
            check_value(item, item_annotation(annotation, name), f"{key}.{name}")
    for index, item in enumerate(value) if isinstance(value, list) else ():
        check_value(item, item_annotation(annotation, index), f"{key}[{index}]")


def locate(path: Any, key: str) -> Callable[..., Any]:
    """What the `_target_` `path` names (as Hydra finds it), refused with the fix if nothing."""
    try:
        target, reason = pydoc.locate(str(path)), "nothing has that name"
    except pydoc.ErrorDuringImport as error:  # the module was found but failed to import
        target, reason = None, str(error.value)
    if not callable(target):
        raise ConfigError(
            f"{key}._target_={path} cannot be imported ({reason}): fix the name, or put its module on "
            f"PYTHONPATH (`PYTHONPATH=. pretrain ...` for a module in the directory you run it from)"
        )
    return target


def signature(target: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """The keyword parameters `target` takes (a class: its `__init__`), and whether it takes others. A class's
    `**kwargs` are taken to reach its base's `__init__`, adding that signature; open-ended only past every base."""
    if isinstance(target, type):
        functions = [cls.__dict__["__init__"] for cls in target.__mro__ if "__init__" in cls.__dict__]
    else:
        functions = [target]
    parameters: dict[str, Any] = {}
    open_ended = True
    for function in functions:
        if function is object.__init__:
            break  # what reaches object goes elsewhere (wandb.init, a writer, ...)
        try:
            accepted = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
            break
        hints = type_hints(function)
        for parameter in accepted:
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and parameter.name != "self":
                parameters.setdefault(parameter.name, hints.get(parameter.name, Any))
        if all(parameter.kind is not parameter.VAR_KEYWORD for parameter in accepted):
            open_ended = False
            break
    for cls in target.__mro__ if isinstance(target, type) else ():
        for name, annotation in EXTRA_ANNOTATIONS.get(f"{cls.__module__}.{cls.__qualname__}", {}).items():
            if name in parameters:
                parameters[name] = annotation
    return parameters, open_ended


def builds(target: Callable[..., Any], annotation: Any) -> bool:
    """Whether a node naming `target` can stand where `annotation` is expected: false only for a class none of the
    annotation's classes (a function's result is unknown here; a mapping takes a node as it is)."""
    if not isinstance(target, type):
        return True
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    classes = []
    for member in members:
        kind = get_origin(member) or member
        if kind is Annotated:
            kind = get_origin(get_args(member)[0]) or get_args(member)[0]
        if member is Any or not isinstance(kind, type) or kind in (object, abc.Callable) or mapping(kind):
            return True
        classes.append(kind)
    try:
        return any(issubclass(target, kind) for kind in classes)
    except TypeError:  # a Protocol that cannot be checked at runtime
        return True


def unknown_key(key: str, value: Any, what: str, known: list[str]) -> ConfigError:
    """The error for a key that is not `what`: naming the closest known key, or all of them."""
    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, known, n=1)
    from pretraining.compat import moved_key  # a key of older layouts (only a refused key needs it)

    if moved := moved_key(key, value):
        fix = moved
    elif close:
        suggestion = f"{parent}.{close[0]}" if parent else close[0]
        fix = f"did you mean {suggestion}? Write {suggestion}={value!r} instead"
    else:
        fix = f"the keys there are {', '.join(known)}; remove it (~{key})"
    return ConfigError(f"{key}={value!r}: {key} is not {what}: {fix}")
