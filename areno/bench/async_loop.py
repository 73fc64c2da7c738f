"""The asynchronous loop against the synchronous one, with stand-ins of fixed cost.

Each run is the real `areno train` (controller, one training rank, one engine
process: `--world-size 1 --rollout-world-size 1 --rollout-engine hf`, the demo's
tiny model) with `--off-policy-steps` K = 0 (synchronous: rollout, then train,
then weight sync) and K = 1 (the engine process generates step k+1 while the
rank trains step k). ARENO_RANK_HOOKS names `FixedCostHooks` below: every train
command takes T seconds and every rollout R seconds, the real work (~0.1 s on
the tiny model) plus a sleep for the rest. Sleeping costs no CPU, so the two
stand-ins never compete for a core: "each on its own core" holds even on a
2-core machine. Weight sync and the controller's work (decode, reward, pack)
are the real ones.

Per R/T the table gives the median time/step over steps WARMUP+1..N (the first
steps hold the first generate and the allocator's warm-up), for K = 0 and
K = 1, against the ideal max(R, T) + sync, sync the median time/weight_sync of
the K = 1 run (rank 0 writing the shared-memory region the engine loads at the
start of its next rollout). Target: K = 1 within 1.15x of the ideal, which at
R = T is about 0.6x of K = 0 (R + T + sync).

    python scripts/bench_async.py                       # T = 0.5 s, R/T in 0.5, 1, 2; 10 steps
    python scripts/bench_async.py --train-s 0.2 --ratios 1 --steps 3 --out r.json

`--demo` instead runs the embedded demo as it is (no stand-ins, 600 steps, seed
0) three times: colocated (today's default), one engine process with K = 0, and
with K = 1; it reports each one's median time/step and the mean reward of its
first and last 20 steps (the issue's "quote its step time against K = 0").

    python scripts/bench_async.py --demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from areno.backend.hooks import RankHooks
from areno.bench.lib import child_env

HOOKS_SPEC = "areno.bench.async_loop:FixedCostHooks"  # the value of ARENO_RANK_HOOKS
ROLLOUT_ENV, TRAIN_ENV, LOG_ENV = "ARENO_BENCH_ASYNC_ROLLOUT_S", "ARENO_BENCH_ASYNC_TRAIN_S", "ARENO_BENCH_ASYNC_LOG"
WARMUP = 2
TARGET_IDEAL, TARGET_SYNC_RATIO = 1.15, 0.6


class FixedCostHooks(RankHooks):
    """Each train command lasts TRAIN_ENV seconds and each rollout ROLLOUT_ENV
    seconds: the real work, then a sleep for what is left. One JSON line per
    command goes to LOG_ENV/<kind><peer>.jsonl: when it began (t, time.monotonic),
    the real work's seconds (work_s) and the command's (total_s), so the bench
    can tell a stand-in that overran and time the steps from the rank's side."""

    def __init__(self) -> None:
        self.train_s = float(os.environ.get(TRAIN_ENV, "0"))
        self.rollout_s = float(os.environ.get(ROLLOUT_ENV, "0"))
        self.log = Path(os.environ[LOG_ENV]) if os.environ.get(LOG_ENV) else None
        self.t0 = self.t_begin = 0.0

    def _hold(self, kind: str, peer: int, cost: float) -> None:
        work = time.perf_counter() - self.t0
        if cost > work:
            time.sleep(cost - work)
        if self.log is not None:
            with open(self.log / f"{kind}{peer}.jsonl", "a") as f:
                rec = {"t": self.t_begin, "work_s": work, "total_s": time.perf_counter() - self.t0}
                f.write(json.dumps(rec) + "\n")

    def train_begin(self, rank: int) -> None:
        self.t0, self.t_begin = time.perf_counter(), time.monotonic()

    def train_end(self, rank: int, local, reply: dict) -> None:
        self._hold("train", rank, self.train_s)

    def rollout_begin(self, peer: int) -> None:
        self.t0, self.t_begin = time.perf_counter(), time.monotonic()

    def rollout_end(self, peer: int, tokens: int) -> None:
        self._hold("rollout", peer, self.rollout_s)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def run_one(k: int, rollout_s: float, train_s: float, steps: int, tmp: Path) -> dict:
    """One `areno train` run -> its measured steps' metrics and the hooks' records."""
    out = tmp / f"k{k}-r{rollout_s:g}-t{train_s:g}"
    log = out / "hooks"
    log.mkdir(parents=True)
    cmd = [sys.executable, "-m", "areno.cli", "train", "--rollout-engine", "hf", "--world-size", "1",
           "--rollout-world-size", "1", "--off-policy-steps", str(k), "--max-steps", str(steps),
           "--seed", "0", "--no-save", "--log-completions", "0", "--output-dir", str(out)]
    env = child_env(ARENO_RANK_HOOKS=HOOKS_SPEC, **{ROLLOUT_ENV: str(rollout_s), TRAIN_ENV: str(train_s),
                                                   LOG_ENV: str(log)})
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    recs = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step" in r]
    measured = [r for r in recs if r["step"] > min(WARMUP, steps - 1)]  # at least the last step
    return {"k": k, "rollout_s": rollout_s, "train_s": train_s, "run_s": time.perf_counter() - t0,
            "steps": measured, "train_cmds": read_jsonl(log / "train0.jsonl"),
            "rollout_cmds": read_jsonl(log / "rollout1.jsonl")}


def med(run: dict, key: str) -> float:
    return float(np.median([r.get(key, 0.0) for r in run["steps"]]))


def period(run: dict) -> float:
    """Median seconds between the starts of consecutive measured train commands:
    the step as the rank sees it, the controller's work between steps included."""
    t = [c["t"] for c in run["train_cmds"]][-len(run["steps"]) - 1:]
    return float(np.median(np.diff(t))) if len(t) > 1 else float("nan")


def summarize(r0: dict, r1: dict) -> dict:
    """One row of the table from the K = 0 and K = 1 runs of one (R, T)."""
    R, T = r0["rollout_s"], r0["train_s"]
    sync = med(r1, "time/weight_sync")
    ideal = max(R, T) + sync
    s0, s1 = med(r0, "time/step"), med(r1, "time/step")
    overrun = max([c["work_s"] - R for c in r0["rollout_cmds"] + r1["rollout_cmds"]]
                  + [c["work_s"] - T for c in r0["train_cmds"] + r1["train_cmds"]])
    return {"ratio": R / T, "rollout_s": R, "train_s": T, "k0_step_s": s0, "k1_step_s": s1,
            "k0_sync_s": med(r0, "time/weight_sync"), "sync_s": sync, "ideal_s": ideal,
            "k1_over_ideal": s1 / ideal, "k1_over_k0": s1 / s0,
            "k0_period_s": period(r0), "k1_period_s": period(r1),
            "k1_wait_batch_s": med(r1, "time/wait_batch"), "k1_wait_weights_s": med(r1, "time/wait_weights"),
            "k1_controller_s": s1 - med(r1, "time/train") - sync - med(r1, "time/wait_batch"),
            "max_overrun_s": overrun, "measured_steps": len(r1["steps"]),
            "train_cmds": len(r0["train_cmds"]) + len(r1["train_cmds"]),
            "rollout_cmds": len(r0["rollout_cmds"]) + len(r1["rollout_cmds"])}


def table(rows: list[dict]) -> str:
    out = ["| R/T | R | T | K=0 step | K=1 step | sync | ideal | K=1/ideal | K=1/K=0 |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['ratio']:g} | {r['rollout_s']:g} s | {r['train_s']:g} s | {r['k0_step_s']:.3f} s | "
                   f"{r['k1_step_s']:.3f} s | {1e3 * r['sync_s']:.0f} ms | {r['ideal_s']:.3f} s | "
                   f"{r['k1_over_ideal']:.2f} | {r['k1_over_k0']:.2f} |")
    return "\n".join(out)


def breakdown(rows: list[dict]) -> str:
    """Where K = 1's step goes beyond the ideal (medians)."""
    out = ["| R/T | K=0 train-to-train | K=1 train-to-train | K=1 wait_batch | K=1 wait_weights (engine idle) "
           "| K=1 controller (step - train - sync - wait) | K=0 weight_sync | stand-in overrun |",
           "| --- " * 8 + "|"]
    for r in rows:
        over = "none" if r["max_overrun_s"] <= 0 else f"{1e3 * r['max_overrun_s']:.0f} ms"
        out.append(f"| {r['ratio']:g} | {r['k0_period_s']:.3f} s | {r['k1_period_s']:.3f} s | "
                   f"{1e3 * r['k1_wait_batch_s']:.0f} ms | {1e3 * r['k1_wait_weights_s']:.0f} ms | "
                   f"{1e3 * r['k1_controller_s']:.0f} ms | {1e3 * r['k0_sync_s']:.0f} ms | "
                   f"{over} |")
    return "\n".join(out)


DEMO_MODES = {"colocated K=0": [], "split K=0": ["--rollout-world-size", "1"],
              "split K=1": ["--rollout-world-size", "1", "--off-policy-steps", "1"]}


def demo_table(steps: int, tmp: Path) -> str:
    """The embedded demo in each DEMO_MODES placement -> a markdown table."""
    out = ["| run | median time/step | steps/s | reward, first 20 -> last 20 | wall |", "| --- " * 5 + "|"]
    for name, flags in DEMO_MODES.items():
        run_dir = tmp / name.replace(" ", "-").replace("=", "")
        cmd = [sys.executable, "-m", "areno.cli", "train", "--seed", "0", "--no-save", "--max-steps", str(steps),
               "--output-dir", str(run_dir), *flags]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        recs = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "time/step" in r]
        step = float(np.median([r["time/step"] for r in recs]))
        reward = np.array([r["reward/mean"] for r in recs])
        out.append(f"| {name} | {1e3 * step:.1f} ms | {1 / step:.1f} | {reward[:20].mean():.3f} -> "
                   f"{reward[-20:].mean():.3f} | {time.perf_counter() - t0:.0f} s |")
        print(f"  {name}: {1e3 * step:.1f} ms/step (load {os.getloadavg()[0]:.1f})", flush=True)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-s", type=float, default=0.5, help="T: seconds per train command")
    ap.add_argument("--ratios", default="0.5,1,2", help="R/T values, comma-separated")
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the first %d are warm-up)" % WARMUP)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--demo", action="store_true", help="the embedded demo colocated, split K=0, split K=1")
    ap.add_argument("--demo-steps", type=int, default=600, help="steps of each demo run (default: the demo's)")
    args = ap.parse_args(argv)
    if args.demo:
        with tempfile.TemporaryDirectory(prefix="areno-async-demo-") as d:
            print(demo_table(args.demo_steps, Path(d)))
        return 0
    if args.steps < 1 or args.train_s <= 0:
        ap.error("--steps must be >= 1 and --train-s > 0")
    ratios = [float(x) for x in args.ratios.split(",") if x]
    rows = []
    with tempfile.TemporaryDirectory(prefix="areno-async-") as d:
        for ratio in ratios:
            R, T = ratio * args.train_s, args.train_s
            r0 = run_one(0, R, T, args.steps, Path(d))
            r1 = run_one(1, R, T, args.steps, Path(d))
            row = summarize(r0, r1)
            rows.append(row)
            print(f"  R/T {ratio:g}: K=0 {row['k0_step_s']:.3f} s, K=1 {row['k1_step_s']:.3f} s "
                  f"(runs {r0['run_s']:.0f} + {r1['run_s']:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nmedian time/step over steps {min(WARMUP, args.steps - 1) + 1}..{args.steps}; "
          f"ideal = max(R, T) + sync (K=1's time/weight_sync)\n")
    print(table(rows))
    print()
    print(breakdown(rows))
    misses = [f"R/T {r['ratio']:g}: K=1/ideal {r['k1_over_ideal']:.2f} > {TARGET_IDEAL}"
              for r in rows if r["k1_over_ideal"] > TARGET_IDEAL]
    misses += [f"R/T 1: K=1/K=0 {r['k1_over_k0']:.2f} > {TARGET_SYNC_RATIO} + 0.05"
               for r in rows if r["ratio"] == 1 and r["k1_over_k0"] > TARGET_SYNC_RATIO + 0.05]
    print("\ntargets: " + ("met" if not misses else "MISSED: " + "; ".join(misses)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "load": os.getloadavg()[0]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
