"""Typed mappings: a dataclass built from the mapping YAML reads, every value checked against
its field's annotation (bool, int, float, str, Literal, Optional / Union, list, nested dataclasses).
Knows nothing of recipes beyond the error it raises, `RecipeError`, which names the dotted key at
fault (`recipe.py` holds the schema and its checks).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Literal, Union

__all__ = ["RecipeError", "from_mapping"]


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key (`key`), then says why (`reason`)."""

    def __init__(self, key: str, message: str):
        self.key, self.reason = key, message
        super().__init__(f"{key}: {message}" if key else message)


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp):
    """value checked (and int -> float widened) against the annotation tp, or RecipeError."""
    origin = typing.get_origin(tp)
    if origin is Union:
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, arg)
            except RecipeError:
                pass
        raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) in {type(a) for a in typing.get_args(tp)}:
            return value
        raise RecipeError(key, f"expected one of {_type_name(tp)}, got {value!r}")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise RecipeError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def from_mapping(cls, data: Any, prefix: str = ""):
    """An instance of dataclass `cls` from a mapping of its field names (nested dataclasses from
    nested mappings, absent keys at their defaults), every value checked against its annotation;
    RecipeError naming the dotted key (under `prefix`) otherwise."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(prefix or "recipe", f"expected a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise RecipeError(dotted, f"unknown key{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_mapping(tp, value, dotted)
        else:
            kwargs[key] = _coerce(dotted, value, tp)
    return cls(**kwargs)
