"""Ranges of config values, declared where a value enters (`Annotated[float, Range(gt=0)]` on a parameter), checked
for Python callers by `@checked_ranges` and for configs by `pretraining.schema`. Plain Python: every floor imports
it."""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pretraining.errors import ConfigError

Function = TypeVar("Function", bound=Callable[..., Any])
UNBOUNDED = "any number"


def finite(value: float) -> bool:
    """Whether `value` is a number and finite; an int is, however large (too large for math.isfinite)."""
    return not isinstance(value, float) or math.isfinite(value)


@dataclass(frozen=True)
class Range:
    """Bounds of a number as `Annotated` metadata (`Range(gt=0, lt=1)`); `why`, in the message, says what a
    non-obvious bound is for. Neither NaN nor infinity is admitted: either would pass the comparisons below and fail
    later, after work has started (a limit meaning "none" is None, not infinity)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    why: str | None = None

    def admits(self, value: float) -> bool:
        if not finite(value):
            return False
        return not (
            (self.gt is not None and value <= self.gt)
            or (self.ge is not None and value < self.ge)
            or (self.lt is not None and value >= self.lt)
            or (self.le is not None and value > self.le)
        )

    def problem(self, value: float) -> str:
        """What `value`, which this range does not admit, must be instead ("must be a finite number > 0")."""
        if finite(value):
            return f"must be {self}"
        return f"must be a finite number {self}" if self.bounds() != UNBOUNDED else "must be a finite number"

    def __str__(self) -> str:
        return f"{self.bounds()} ({self.why})" if self.why else self.bounds()

    def bounds(self) -> str:
        low, high = (self.gt, self.ge), (self.lt, self.le)
        if any(bound is not None for bound in low) and any(bound is not None for bound in high):
            opening = f"({self.gt}" if self.gt is not None else f"[{self.ge}"
            closing = f"{self.lt})" if self.lt is not None else f"{self.le}]"
            return f"in {opening}, {closing}"
        for bound, words in ((self.gt, "> {}"), (self.ge, "at least {}"), (self.lt, "< {}"), (self.le, "at most {}")):
            if bound is not None:
                return words.format(bound)
        return UNBOUNDED


Positive = Annotated[int, Range(ge=1)]


def checked_ranges(prefix: str) -> Callable[[Function], Function]:
    """Decorate a constructor so an argument outside its annotation's `Range` raises a ConfigError naming
    `<prefix>.<parameter>`: Python callers get the checks a config gets at startup."""

    def decorate(function: Function) -> Function:
        parameters = inspect.signature(function)

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            arguments = parameters.bind(*args, **kwargs)
            arguments.apply_defaults()
            for name, annotation in type_hints(function).items():
                if name in arguments.arguments:
                    check_range(arguments.arguments[name], annotation, f"{prefix}.{name}")
            return function(*args, **kwargs)

        return typing.cast(Function, checked)

    return decorate


def check_range(value: Any, annotation: Any, key: str) -> None:
    """Raise a ConfigError if `value`, or an item of it, is outside the `Range` its annotation declares."""
    problem = range_problem(value, annotation)
    if problem:
        raise out_of_range(key, value, problem)
    for index, item in enumerate(value) if isinstance(value, list | tuple) else ():
        check_range(item, item_annotation(annotation, index), f"{key}[{index}]")


def out_of_range(key: str, value: Any, problem: str) -> ConfigError:
    return ConfigError(f"{key}={value} {problem}: set {key} within that range")


@functools.cache
def type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of `function`; none if unresolvable here (names imported only for type checkers)."""
    try:
        return typing.get_type_hints(inspect.unwrap(function), include_extras=True)
    except Exception:
        return {}


def fits(value: Any, annotation: Any) -> bool:
    """Whether a config value (None, bool, int, float, str, list, dict) can be `annotation`; true where it cannot be
    checked (classes, callables, type variables)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return fits(value, args[0])
    if origin in (Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if origin is Literal:
        return any(value == arg and type(value) is type(arg) for arg in args)
    if annotation in (None, type(None)):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return isinstance(value, list | tuple) and len(value) == len(args)
    if sequence(origin or annotation):
        return isinstance(value, list | tuple)
    if mapping(origin or annotation):
        return isinstance(value, dict)
    return True


def range_problem(value: Any, annotation: Any) -> str | None:
    """The range a `value` that `fits` the annotation misses ("must be at least 1"), or None."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        ranges = [meta for meta in args[1:] if isinstance(meta, Range)]
        return range_problem(value, args[0]) or next((r.problem(value) for r in ranges if not r.admits(value)), None)
    if origin in (Union, types.UnionType):
        problems = [range_problem(value, arg) for arg in args if fits(value, arg)]
        return None if not problems or None in problems else problems[0]
    return None


def item_annotation(annotation: Any, key: Any) -> Any:
    """The annotation of one item of a list (index `key`) or dict (key `key`) annotated `annotation`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return item_annotation(args[0], key)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return args[key] if isinstance(key, int) and key < len(args) else Any
    if args and (origin is tuple or sequence(origin)):
        return args[0]
    if len(args) == 2 and mapping(origin):
        return args[1]
    return Any


def sequence(kind: Any) -> bool:
    return kind in (list, tuple, set, frozenset, abc.Sequence, abc.MutableSequence, abc.Iterable, abc.Collection)


def mapping(kind: Any) -> bool:
    return kind in (dict, abc.Mapping, abc.MutableMapping)


def describe(annotation: Any) -> str:
    """`annotation` in words, as a config value."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return describe(args[0])
    if origin in (Union, types.UnionType):
        # All Literal members' values in one list (Lightning's precision is a union of three).
        values = [value for arg in args if get_origin(arg) is Literal for value in get_args(arg)]
        others = [describe(arg) for arg in args if get_origin(arg) is not Literal]
        return " or ".join(dict.fromkeys([describe(Literal[tuple(values)])] * bool(values) + others))
    if origin is Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    words = {None: "null", type(None): "null", bool: "true or false", int: "an integer", float: "a number"}
    if annotation in words:
        return words[annotation]
    if annotation is str:
        return "a string"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} items"
    if sequence(origin or annotation):
        return f"a list of {describe(args[0])}" if args else "a list"
    if mapping(origin or annotation):
        return "a mapping"
    name = getattr(origin or annotation, "__qualname__", str(annotation))
    return f"a {name} (a node with _target_)"
