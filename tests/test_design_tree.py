"""docs/DESIGN.md's module tree ("Shape of the system") names every module of the
package, and only modules that exist: a module added, moved or removed without
the tree changing fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "areno"


def tree_modules() -> set[str]:
    """Module paths (relative to areno/) the tree names: `├─ name.py` at the top,
    `├─ pkg/` opening a package whose `│    x.py, sub/y.py` lines name its modules."""
    text = (REPO / "docs" / "DESIGN.md").read_text()
    block = text[text.index("```\nareno train (typer CLI"):]
    block = block[: block.index("```", 4)]
    names, pkg = set(), ""
    for line in block.splitlines():
        if m := re.match(r"\s*[├└]─ (\w+)/", line):
            pkg = m.group(1) + "/"
            continue
        if m := re.match(r"\s*[├└]─ ([\w.]+\.py)", line):
            pkg = ""
            names.add(m.group(1))
            continue
        lead = re.match(r"[\s│]*((?:[\w/]+\.py)(?:, [\w/]+\.py)*)", line)
        if pkg and lead and len(line) - len(line.lstrip(" │")) <= 7:
            names |= {pkg + n for n in lead.group(1).split(", ")}
    return names


def holds_code(path: Path) -> bool:
    """Anything but a docstring (an __init__.py that only says what its package is)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body)


def package_modules() -> set[str]:
    """Every .py of the package that holds code (areno/__init__.py: the version)."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p != PACKAGE / "__init__.py" and (p.name != "__init__.py" or holds_code(p))}


def test_the_design_tree_names_every_module_and_no_other():
    named = tree_modules()
    missing = package_modules() - named
    assert not missing, f"modules missing from docs/DESIGN.md's tree: {sorted(missing)}"
    ghosts = {n for n in named if not (PACKAGE / n).is_file()}
    assert not ghosts, f"docs/DESIGN.md's tree names modules that do not exist: {sorted(ghosts)}"
