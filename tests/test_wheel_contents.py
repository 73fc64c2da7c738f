"""The wheel holds areno and nothing only the suite or the benchmarks use: the
benchmarks' library and the real model's builder live in scripts/arenobench/,
which the package discovery leaves out and no module of areno imports."""

from __future__ import annotations

import ast
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from setuptools.config.expand import find_packages

REPO = Path(__file__).resolve().parents[1]
FIND = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
MOVED = ("arenobench", "areno.bench", "areno.models.smol")  # the benchmarks' code, by module name


def test_the_package_discovery_finds_areno_and_its_subpackages_only():
    found = find_packages(**FIND, root_dir=REPO)  # what setuptools puts in the wheel
    assert "areno" in found and "areno.backend" in found
    assert all(p == "areno" or p.startswith("areno.") for p in found), sorted(found)
    assert not [p for p in found if p.startswith(MOVED)], sorted(found)
    include = FIND.get("include", ["*"])
    for name in ("arenobench", "scripts", "scripts.arenobench", "tests"):  # were one ever discoverable
        assert not any(fnmatch(name, pat) for pat in include), f"packages.find include {include} admits {name}"


def test_no_benchmark_code_is_in_or_imported_by_the_package():
    assert not (REPO / "areno" / "bench").exists() and not (REPO / "areno" / "models" / "smol.py").exists()
    assert (REPO / "scripts" / "arenobench" / "lib.py").is_file()
    imports = []
    for path in sorted((REPO / "areno").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            imports += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith(MOVED)]
    assert not imports, imports
