"""One option's value against its declaration: its type (bool, int, float, str,
one of a Literal's choices, or None where the type is Optional) and the bounds
that `config.opt(ge=, gt=, le=, lt=)` records. A mismatch is a UserError naming
the flag. Also: a file option's file exists (check_file)."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
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


def looks_local(s: str) -> bool:
    """A path, not a hub id: it starts like one or exists."""
    return s.startswith((".", "/", "~")) or os.path.exists(s)


def check_file(flag: str, path: str, suffix: str | None = None) -> None:
    """A file option names an existing file (with `suffix`, when given)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{flag}: file not found: {path}")
    if suffix and p.suffix != suffix:
        raise UserError(f"{flag}: expected a {suffix} file, got {path}")
