"""Benchmarks against a reference revision (`--ref REV`): a `git worktree` of it
in a temp dir, run in turn with the checkout the benchmark lives in (uncommitted
changes included), so the ratio comes from one run on one host.

Before a change to the loop, the backend, threads or the pack, run all three
(docs/PERFORMANCE.md, "Before a change"):

    python scripts/bench_materialize.py --ref main
    python scripts/bench_step_commits.py --ref main
    PYTHONPATH=.:/tmp/trlsite python scripts/bench_demo_vs_trl.py --ref main
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CURRENT = "."  # the checkout itself, as it is on disk


def rev_id(rev: str) -> str:
    """`rev` as a short commit id (HEAD moves; a report names what ran); CURRENT stays."""
    if rev == CURRENT:
        return CURRENT
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev],
                          check=True, capture_output=True, text=True).stdout.strip()


def label(rev: str) -> str:
    """How a report names a revision: CURRENT is "tree" (this checkout)."""
    return "tree" if rev == CURRENT else rev


@contextmanager
def worktrees(revs: Sequence[str], root: Path) -> Iterator[dict[str, Path]]:
    """{rev: a detached `git worktree` of it under root}, removed on exit;
    CURRENT maps to this checkout (nothing is made for it)."""
    made: dict[str, Path] = {}
    trees: dict[str, Path] = {}
    try:
        for i, rev in enumerate(revs):
            if rev == CURRENT:
                trees[rev] = REPO
                continue
            path = root / f"wt{i}"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
                           check=True, capture_output=True, text=True)
            made[rev] = trees[rev] = path
        yield trees
    finally:
        for path in made.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                           capture_output=True)
