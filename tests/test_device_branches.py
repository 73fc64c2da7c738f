"""The device-branch inventory (issue 26, 5): docs/BACKEND.md, "Device branches",
lists every function of areno/ that branches on the device (CUDA available,
on_gpu, a device's type, dtype and memory defaults by device or placement)
with the CPU test that takes it. This test reads the package (AST) and fails
when a branch appears that the table does not name, when a row names a
function that no longer branches, or when a row's test does not exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- device-branches -->", "<!-- /device-branches -->"
# What a device condition looks like in the package's code.
DEVICE = re.compile(r"""torch\.cuda|is_available|\bon_gpu\b|\bon_cpu\b|\bis_cuda\b|is_cpu\(|device\.type"""
                    r"""|\.type\s*[!=]=|\bdevice\w*\s*[!=]=\s*['"]|['"]cuda['"]|(?i:gpu_memory)""")
CALLS = {"is_available", "is_cpu", "startswith", "get"}


def candidates(node: ast.AST) -> list[ast.AST]:
    """The parts of `node` that can hold a device condition: branch tests, whole
    conditional expressions, comparisons, device queries, device-keyed dicts."""
    out: list[ast.AST] = []
    if isinstance(node, (ast.If, ast.While)):
        out.append(node.test)
    if isinstance(node, (ast.IfExp, ast.Compare, ast.BoolOp)):
        out.append(node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS:
        out.append(node)
    if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
        out.append(node)
    if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "cuda" for k in node.keys):
        out.append(node)
    return out


def device_branches() -> set[str]:
    """'areno/file.py:Qualified.function' (or ':<module>') of every device branch."""
    found: set[str] = set()
    for path in sorted((ROOT / "areno").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()

        def visit(node: ast.AST, qual: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, f"{qual}.{child.name}" if qual else child.name)
                    continue
                if any(DEVICE.search(ast.unparse(c)) for c in candidates(child)):
                    found.add(f"{rel}:{qual or '<module>'}")
                visit(child, qual)

        visit(ast.parse(path.read_text()), "")
    return found


def table() -> dict[str, list[str]]:
    """The table's rows: branch -> the tests its last column names."""
    doc = (ROOT / "docs" / "BACKEND.md").read_text()
    body = doc[doc.index(TABLE_START):doc.index(TABLE_END)]
    rows: dict[str, list[str]] = {}
    for line in body.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if m:
            rows[m.group(1)] = re.findall(r"tests/[\w/]+\.py::\w+", line.rsplit("|", 2)[-2])
    return rows


def test_the_scan_finds_a_branch_it_is_shown() -> None:
    src = 'def f(d):\n    return 1 if d.type == "cuda" else 2\n\ndef g(d):\n    return d\n'
    tree = ast.parse(src)
    hits = [fn.name for fn in tree.body if any(DEVICE.search(ast.unparse(c))
                                               for n in ast.walk(fn) for c in candidates(n))]
    assert hits == ["f"]


def test_every_device_branch_is_in_the_table_with_a_real_test() -> None:
    rows, found = table(), device_branches()
    assert len(found) >= 21  # the issue counted about 21
    missing, stale = sorted(found - rows.keys()), sorted(rows.keys() - found)
    assert not missing, f"device branches the table in docs/BACKEND.md does not name: {missing}"
    assert not stale, f"rows of docs/BACKEND.md's device table that branch no more: {stale}"
    for branch, tests in rows.items():
        assert tests, f"{branch}: no test named"
        for ref in tests:
            file, name = ref.split("::")
            defs = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text()))
                    if isinstance(n, ast.FunctionDef)}
            assert name in defs, f"{branch}: {ref} does not exist"
