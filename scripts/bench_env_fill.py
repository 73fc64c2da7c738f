"""Multi-turn rollouts with heavy-tailed environment delays, split placement,
--partial-rollouts at K = 2: this checkout against a reference revision (`--ref`,
a `git worktree` of it), runs interleaved (ABBA), the real CLI on the demo's
tiny model and engine (transformers). What is compared: trained tokens per
second of step time over the steps after the start-up rounds, the step time's
median, and the engines' share of time waiting on environments.

The environment (written to a temp dir): every step sleeps a lognormal delay
(median --median-s, sigma --sigma, capped at --cap-s), drawn from a generator
seeded by (trajectory, turn), so both revisions see the same delays per
trajectory turn; a trajectory ends after --turns steps.

    PYTHONPATH=.:scripts python scripts/bench_env_fill.py --ref 867cfdc
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arenobench.lib import child_env
from arenobench.refs import CURRENT, rev_id, worktrees
from arenobench.refs import label as rev_label

ENV_SRC = '''
import math, random, time, zlib
def step(state, completion):
    state.data["n"] = state.data.get("n", 0) + 1
    key = zlib.crc32(state.prompt.encode()) % 65_536
    rng = random.Random(1_000_003 * state.index + 7919 * key + state.data["n"])
    time.sleep(min({cap}, {median} * math.exp({sigma} * rng.gauss(0.0, 1.0))))
    return f"seen {{state.data['n']}}", float(len(completion) % 2), state.data["n"] >= {turns}
'''


def run_once(tree: Path, out: Path, env: Path, args: argparse.Namespace) -> dict[str, float]:
    """One `areno train` in worktree `tree` -> its figures over steps > K + 1."""
    cmd = [sys.executable, "-m", "areno.cli", "train", "--env-path", str(env), "--max-turns", str(args.turns + 1),
           "--rollout-world-size", "1", "--off-policy-steps", "2", "--partial-rollouts",
           "--batch-size", str(args.batch_size), "--n-samples", str(args.n), "--reward-workers", str(args.workers),
           "--max-steps", str(args.steps), "--seed", "0", "--no-save", "--output-dir", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=tree, env=child_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r.get("step", 0) > 3 and "time/step" in r]
    step_s = sum(r["time/step"] for r in steady)
    return {"tokens_per_s": sum(r["train/loss_tokens"] for r in steady) / step_s,
            "step_s": statistics.median(r["time/step"] for r in steady),
            "env_idle": sum(r.get("env/engine_idle_s", 0.0) for r in steady) / step_s,
            "tail_filled": sum(r.get("rollout/tail_filled", 0.0) for r in steady), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="HEAD~1", help="the reference revision")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--median-s", type=float, default=0.2)
    ap.add_argument("--sigma", type=float, default=1.5)
    ap.add_argument("--cap-s", type=float, default=4.0)
    args = ap.parse_args()
    revs = [rev_id(args.ref), CURRENT]
    runs: dict[str, list[dict[str, float]]] = {r: [] for r in revs}
    with tempfile.TemporaryDirectory() as tmp, worktrees(revs, Path(tmp)) as trees:
        env = Path(tmp) / "env.py"
        env.write_text(ENV_SRC.format(cap=args.cap_s, median=args.median_s, sigma=args.sigma, turns=args.turns))
        for i in range(args.repeats):
            for rev in revs if i % 2 == 0 else revs[::-1]:
                runs[rev].append(run_once(trees[rev], Path(tmp) / f"run{i}{len(runs[rev])}{rev_label(rev)}",
                                          env, args))
                print(rev_label(rev), json.dumps({k: round(v, 3) for k, v in runs[rev][-1].items()}), flush=True)
    med = {r: {k: statistics.median(x[k] for x in runs[r]) for k in runs[r][0]} for r in revs}
    print("\n| revision | trained tokens/s | step s (median) | env idle share | tail filled |")
    print("| --- | --- | --- | --- | --- |")
    for r in revs:
        m = med[r]
        print(f"| {rev_label(r)} | {m['tokens_per_s']:.1f} | {m['step_s']:.2f} | {m['env_idle']:.0%} | "
              f"{m['tail_filled']:.0f} |")
    print(f"tree / {revs[0]}: trained tokens/s {med[CURRENT]['tokens_per_s'] / med[revs[0]]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
