"""bench_materialize --ref REV: REV's bench and this checkout's, each in its own
process, in turn, and areno's time ratio per workload (this checkout / REV)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from arenobench.lib import median, write_json
from arenobench.refs import CURRENT, rev_id, worktrees


def against_ref(args: argparse.Namespace) -> int:
    """--ref REV: REV's bench_materialize (a git worktree) and this checkout's, each
    in its own process, in turn (ABBA) for --ref-rounds rounds; per workload the
    median of areno's medians and the ratio this checkout / REV."""
    revs = [rev_id(args.ref), CURRENT]
    got: dict[str, list[dict[str, Any]]] = {rev: [] for rev in revs}
    with tempfile.TemporaryDirectory(prefix="areno-materialize-ref-") as d, worktrees(revs, Path(d)) as trees:
        for i in range(args.ref_rounds):
            for rev in revs if i % 2 == 0 else revs[::-1]:
                out = Path(d) / f"round{i}-{len(got[rev])}-{rev.strip('.') or 'tree'}.json"
                cmd = [sys.executable, str(trees[rev] / "scripts" / "bench_materialize.py"), "--repeats",
                       str(args.repeats), "--out", str(out), *(["--quick"] if args.quick else [])]
                res = subprocess.run(cmd, cwd=trees[rev], env={**os.environ, "PYTHONPATH": str(trees[rev])},
                                     capture_output=True, text=True)
                if not out.exists():
                    raise SystemExit(f"{' '.join(cmd)} failed (rc {res.returncode}):\n{res.stderr[-2000:]}")
                got[rev].append(json.loads(out.read_text())["workloads"])
                print(f"  round {i + 1}: {'this checkout' if rev == CURRENT else rev} done", flush=True)
    print(ref_table(got, revs[0]))
    write_json(args.out, {"ref": revs[0], "runs": got})
    print(f"wrote {args.out}")
    return 0


def ref_table(got: dict[str, list[dict[str, Any]]], ref: str) -> str:
    """Per workload both trees run: median over rounds of areno's median, tree / ref."""
    lines = [f"{'workload':<17} {ref + ' ms':>12} {'tree ms':>12} {'tree/' + ref:>14}"]
    names = [n for n in got["."][0] if all(n in w for runs in got.values() for w in runs)]
    for name in names:
        m = {rev: median([w[name]["areno"]["median_s"] for w in runs]) for rev, runs in got.items()}
        lines.append(f"{name:<17} {m[ref] * 1e3:>12.3f} {m['.'] * 1e3:>12.3f} {m['.'] / m[ref]:>13.2f}x")
    return "\n".join(lines)
