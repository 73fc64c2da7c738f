"""Small modules with one job each: no module of the package over 400 lines and
no function over 60 (the style the project holds itself to; a part that grows
past them is split by what it holds, not trimmed)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "areno"
MODULE_LINES, FUNCTION_LINES = 400, 60


def sizes() -> tuple[list[str], list[str]]:
    """-> (modules over MODULE_LINES, functions over FUNCTION_LINES), as 'path[:name] lines'."""
    modules, functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        if src.count("\n") > MODULE_LINES:
            modules.append(f"{rel} {src.count(chr(10))}")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    functions.append(f"{rel}:{node.name} {n}")
    return modules, functions


def test_no_module_or_function_outgrows_the_style():
    modules, functions = sizes()
    assert not modules, f"modules over {MODULE_LINES} lines: {modules}"
    assert not functions, f"functions over {FUNCTION_LINES} lines: {functions}"
