"""The wheel holds areno and nothing only the suite or the benchmarks use: the
benchmarks' library and the real model's builder live in scripts/arenobench/,
which the package discovery leaves out and no module of areno imports; the
processes the benchmarks start still find it."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("module", ["arenobench.async_loop", "arenobench.longcot.ranks"])
def test_a_process_a_benchmark_starts_builds_its_rank_hooks(module, tmp_path, monkeypatch):
    """child_env gives a child (`python -m areno.cli train`, whose ranks build what
    ARENO_RANK_HOOKS names) the checkout's scripts/ too, outside the package."""
    from arenobench.lib import child_env
    from arenobench.longcot.ranks import PROBE_DIR_ENV

    spec = importlib.import_module(module).HOOKS_SPEC
    monkeypatch.delenv("PYTHONPATH", raising=False)  # what child_env adds alone (the suite adds scripts/ too)
    code = "from areno.backend.hooks import load_rank_hooks; print(type(load_rank_hooks()).__name__)"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=child_env(ARENO_RANK_HOOKS=spec, **{PROBE_DIR_ENV: str(tmp_path)}))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [spec.partition(":")[2]]
