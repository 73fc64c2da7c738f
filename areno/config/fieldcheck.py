"""One option's value against its declaration: its type (bool, int, float, str,
one of a Literal's choices, or None where the type is Optional) and the bounds
that `config.opt(ge=, gt=, le=, lt=)` records. A mismatch is a UserError naming
the flag."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from areno.errors import UserError


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def base_type(hint: Any) -> Any:
    """Strip Optional[...]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def check_value(f: dataclasses.Field, hint: Any, value: Any) -> None:
    """UserError unless `value` fits field `f`, declared with type `hint`."""
    flag = flag_name(f.name)
    if value is None:
        if type(None) not in typing.get_args(hint):
            raise UserError(f"{flag}: a value is required")
        return
    base = base_type(hint)
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if value not in choices:
            raise UserError(f"{flag}: expected one of {', '.join(map(str, choices))}; got {value!r}")
        return
    if base is bool:
        if not isinstance(value, bool):
            raise UserError(f"{flag}: expected true or false; got {value!r}")
        return
    if base in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            base is int and not float(value).is_integer()
        ):
            raise UserError(f"{flag}: expected {'an integer' if base is int else 'a number'}; "
                            f"got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise UserError(f"{flag}: must be finite; got {value!r}")
        m = f.metadata
        for key, ok, word in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                              ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
            bound = m.get(key)
            if bound is not None and not ok(value, bound):
                raise UserError(f"{flag} must be {word} {bound}; got {value!r}")
        return
    if base is str and not isinstance(value, str):
        raise UserError(f"{flag}: expected a string; got {value!r}")
