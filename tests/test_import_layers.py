"""The package's parts form layers: no import cycle between them, and each imports
only from its own layer or the layers below it (docs/DESIGN.md, "Layers").

A part is a package directly under areno/ (`backend/`: every module in it) or a
top-level module (`trainer.py`: each one on its own, since the training story's
modules sit at the top beside the leaves they share). An import is every
`import areno.x` / `from areno.x import ...` anywhere in a module: at the top,
inside a function (a lazy import still needs the module it names; one that
exists only to dodge a cycle is still a cycle) and under `if TYPE_CHECKING:` (a
type a part names is a part it knows). Imports inside one part are its own
business; only edges between parts count.

`python tests/test_import_layers.py` prints the parts level by level (each
imports only from levels above it in the listing) and the edges.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "areno"

# Bottom to top. A part may import from its own layer and the ones before it.
# A part not listed only takes part in the cycle check (add it where it belongs).
LAYERS: tuple[tuple[str, ...], ...] = (
    # leaves: errors, shared vocabularies, pure helpers
    ("errors.py", "choices.py", "timing.py", "metrics.py", "stats.py", "perf.py", "fileperms.py"),
    ("procs/",),                                   # torch-free process layer
    ("models/",),
    ("rollout/",),                                 # engines, RolloutBatch
    ("data/",),
    ("rundir/", "rewards/"),                       # what a run writes; reward plugins and workers
    ("continuation.py",),                          # halted samples spliced on resume, pure
    ("envs/",),
    ("gateway/",),                                 # agents over HTTP: an env whose observations are requests
    ("config/",),                                  # TrainConfig and its rules
    ("advantages.py", "losses.py", "pack.py", "split.py"),
    ("fleet/",),                                   # the engines: in a peer, engine processes, sync
    ("backend/",),                                 # the ranks and TorchBackend (never engine processes)
    ("settings.py", "runtime/", "scoring.py", "dynsample.py", "partial.py", "part_groups.py", "evaluate.py"),
    ("producers.py",),                             # where a round comes from, every placement
    ("inflight.py", "first_finished.py", "inflight_file.py"),  # a round in flight, the K bound; batches
                                                   # by group; the checkpoint's file of them
    ("scheduler.py",),                             # the rollout scheduler every run has
    ("run.py",),
    ("trainer.py",),
    ("cli/",),
)


def part_of(module: str) -> str | None:
    """'areno.backend.rank' -> 'backend/', 'areno.trainer' -> 'trainer.py'; None
    for areno itself or a name that is no module of the package."""
    parts = module.split(".")
    if parts[0] != "areno" or len(parts) < 2:
        return None
    if (PACKAGE / parts[1]).is_dir():
        return parts[1] + "/"
    if (PACKAGE / f"{parts[1]}.py").is_file():
        return parts[1] + ".py"
    return None


def imported_modules(tree: ast.AST, module: str, is_pkg: bool) -> list[tuple[str, int]]:
    """Every areno module `tree` imports, anywhere in it: (dotted name, line)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                pkg = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                base = ".".join(pkg + ([base] if base else []))
            # `from areno import settings`: the names may be modules themselves
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names] if base == "areno" \
                else [(base, node.lineno)]
    return [(m, line) for m, line in out if m.startswith("areno.")]


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importer part, imported part) -> where: 'areno/x/y.py:LINE imports areno.z'."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO)
        is_pkg = path.name == "__init__.py"
        module = ".".join(rel.with_suffix("").parts[: -1 if is_pkg else None])
        src = part_of(module)
        if src is None:
            continue
        for name, line in imported_modules(ast.parse(path.read_text()), module, is_pkg):
            dst = part_of(name)
            if dst is not None and dst != src:
                edges[(src, dst)].append(f"{rel}:{line} imports {name}")
    return edges


def find_cycle(edges: dict[tuple[str, str], list[str]]) -> list[str] | None:
    """One cycle of the part graph as [a, b, ..., a], or None."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        succ[a].append(b)
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in succ[n]:
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(succ):
        if n not in state and (found := visit(n)):
            return found
    return None


def levels(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The parts by level: level 0 imports no other part, level k only parts of
    levels below k (the graph must be acyclic)."""
    nodes = {n for e in edges for n in e}
    deps = {n: {b for a, b in edges if a == n} for n in nodes}
    level: dict[str, int] = {}
    while len(level) < len(nodes):
        for n in sorted(nodes - level.keys()):
            if deps[n] <= level.keys():
                level[n] = 1 + max((level[d] for d in deps[n]), default=-1)
    return [sorted(n for n in nodes if level[n] == k) for k in range(max(level.values()) + 1)]


def test_no_import_cycle_between_the_parts():
    edges = import_edges()
    cycle = find_cycle(edges)
    if cycle:
        hops = "\n".join(f"  {a} -> {b}: {edges[(a, b)][0]}" for a, b in zip(cycle, cycle[1:]))
        raise AssertionError(f"import cycle {' -> '.join(cycle)}:\n{hops}")


def test_each_part_imports_only_its_layer_and_the_ones_below():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    upward = [f"{a} (layer {rank[a]}) -> {b} (layer {rank[b]}): {where[0]}"
              for (a, b), where in sorted(import_edges().items())
              if a in rank and b in rank and rank[b] > rank[a]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_process_layer_does_not_import_torch():
    """Ranks spawn before the controller imports torch (runtime/early.py): every
    module of areno.procs loads without it."""
    mods = sorted(f"areno.procs.{p.stem}" for p in (PACKAGE / "procs").glob("*.py") if p.stem != "__init__")
    code = "import sys\n" + "".join(f"import {m}\n" for m in mods) + \
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert len(mods) >= 5 and out.stdout.strip() == "[]", (mods, out.stdout, out.stderr)


def test_the_cycle_check_names_a_cycle():
    """The checker itself: a lazy import back from a lower part is a cycle."""
    edges = {("rundir/", "procs/"): ["a"], ("procs/", "models/"): ["b"], ("models/", "rundir/"): ["c"],
             ("cli/", "rundir/"): ["d"]}
    assert find_cycle(edges) == ["rundir/", "procs/", "models/", "rundir/"]
    del edges[("models/", "rundir/")]
    assert find_cycle(edges) is None
    assert levels(edges) == [["models/"], ["procs/"], ["rundir/"], ["cli/"]]


if __name__ == "__main__":
    found = import_edges()
    for k, names in enumerate(levels(found)):
        print(f"level {k}: {' '.join(names)}")
    print()
    for (a, b) in sorted(found):
        print(f"{a} -> {b}")
