"""The asynchronous loop against the synchronous one, with stand-ins of fixed cost.

Each run is the real `areno train` (controller, one training rank, one engine
process: `--world-size 1 --rollout-world-size 1 --rollout-engine hf`, the demo's
tiny model) with `--off-policy-steps` K = 0 (synchronous: rollout, then train,
then weight sync) and K = 1, 2, 4 (the engine process generates up to K steps
ahead while the rank trains step k). ARENO_RANK_HOOKS names `FixedCostHooks`
below: every train command takes T seconds and every rollout R seconds, the
real work (~0.1 s on the tiny model) plus a sleep for the rest. Sleeping costs
no CPU, so the two stand-ins never compete for a core: "each on its own core"
holds even on a 2-core machine. Weight sync and the controller's work (decode,
reward, pack) are the real ones.

Two kinds of rollout time:

  fixed  every rollout takes R (R/T in --ratios): K = 1 already reaches the ideal
         max(R, T) + sync, and more K buys nothing.
  tail   a heavy-tailed generation time, as in long-CoT: rollout i takes the
         longest of --tail-completions completion times drawn from a lognormal
         (sigma --tail-sigma, seeded by i, the same sequence for every K), scaled
         so that the mean rollout takes --tail-ratio x T. A few long completions
         make a few steps' rollouts several times the mean. K = 1 pays each long
         one in full (its step is max(R_i, T)); with K > 1 the engine works off
         the long one while the rank trains on batches queued before it, and the
         step time approaches the ideal max(mean R, T) + sync.

Per scenario the table gives the mean time/step over steps WARMUP+1..N (the
first steps hold the first generate and the allocator's warm-up) for each K,
against the ideal max(mean R, T) + sync (sync: the median time/weight_sync of
the K >= 1 runs, rank 0 writing the shared-memory region the engine loads at
the start of its next rollout) and against K = 1. Targets: with fixed costs
K = 1 within 1.15x of the ideal, which at R = T is about 0.6x of K = 0
(R + T + sync); with the tail, K = 4 below K = 1.

    python scripts/bench_async.py                       # T = 0.5 s, R/T in 0.5, 1, 2 and the tail
    python scripts/bench_async.py --train-s 0.2 --ratios 1 --steps 3 --ks 0,1 --no-tail --out r.json

`--partial` instead simulates partial rollouts (areno.partial's policy) against
synchronous and K-ahead rounds on a long-tail workload (lognormal lengths,
sigma --tail-sigma) and on an environment with heavy-tailed delays, and prints
trained tokens per tick and engine idle fraction side by side
(arenobench/partial_sim.py says what is modelled). `--partial-real` runs the
real loop on the tail instead (arenobench/partial_real.py): K = 0, K-ahead and
--partial-rollouts at --partial-k.

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
from arenobench.lib import child_env

HOOKS_SPEC = "arenobench.async_loop:FixedCostHooks"  # the value of ARENO_RANK_HOOKS
ROLLOUT_ENV, TRAIN_ENV, LOG_ENV = "ARENO_BENCH_ASYNC_ROLLOUT_S", "ARENO_BENCH_ASYNC_TRAIN_S", "ARENO_BENCH_ASYNC_LOG"
TIMES_ENV = "ARENO_BENCH_ASYNC_ROLLOUT_TIMES"  # a JSON list: rollout i's seconds (the tail)
HOLD_ENV = "ARENO_BENCH_ASYNC_HOLD_AT"  # "begin": a rollout's stand-in time before it decodes (partial_real.py)
WARMUP = 2
TARGET_IDEAL, TARGET_SYNC_RATIO = 1.15, 0.6


class FixedCostHooks(RankHooks):
    """Each train command lasts TRAIN_ENV seconds and each rollout ROLLOUT_ENV
    seconds: the real work, then a sleep for what is left. One JSON line per
    command goes to LOG_ENV/<kind><peer>.jsonl: when it began (t, time.monotonic),
    the real work's seconds (work_s) and the command's (total_s), so the bench
    can tell a stand-in that overran (work_s > cost_s) and time the steps from
    the rank's side. With TIMES_ENV rollout i takes the list's i-th seconds."""

    def __init__(self) -> None:
        self.train_s = float(os.environ.get(TRAIN_ENV, "0"))
        self.rollout_s = float(os.environ.get(ROLLOUT_ENV, "0"))
        times = os.environ.get(TIMES_ENV)
        self.rollout_times = json.loads(Path(times).read_text()) if times else None  # the tail's, by rollout
        self.rollouts = 0
        self.log = Path(os.environ[LOG_ENV]) if os.environ.get(LOG_ENV) else None
        # Held before decoding, weights offered meanwhile (--partial-rollouts) reach the
        # round's first step boundary: the stand-in's time counts as decoding time.
        self.hold_at_begin = os.environ.get(HOLD_ENV) == "begin"
        self.t0 = self.t_begin = 0.0

    def _hold(self, kind: str, peer: int, cost: float) -> None:
        work = time.perf_counter() - self.t0
        if cost > work:
            time.sleep(cost - work)
        if self.log is not None:
            with open(self.log / f"{kind}{peer}.jsonl", "a") as f:
                rec = {"t": self.t_begin, "work_s": work, "cost_s": cost, "total_s": time.perf_counter() - self.t0}
                f.write(json.dumps(rec) + "\n")

    def train_begin(self, rank: int) -> None:
        self.t0, self.t_begin = time.perf_counter(), time.monotonic()

    def train_end(self, rank: int, local, reply: dict) -> None:
        self._hold("train", rank, self.train_s)

    def rollout_begin(self, peer: int) -> None:
        self.t0, self.t_begin = time.perf_counter(), time.monotonic()
        if self.hold_at_begin:
            self._hold("rollout", peer, self._next_cost())

    def rollout_end(self, peer: int, tokens: int) -> None:
        if not self.hold_at_begin:
            self._hold("rollout", peer, self._next_cost())

    def _next_cost(self) -> float:
        times, i = self.rollout_times, self.rollouts
        self.rollouts += 1
        return times[i % len(times)] if times else self.rollout_s


def tail_times(n: int, mean_s: float, completions: int, sigma: float) -> list[float]:
    """n rollout times: rollout i the longest of `completions` lognormal(0, sigma)
    draws (rng seeded by i), scaled to mean `mean_s` over the n."""
    longest = np.array([np.random.default_rng(i).lognormal(0.0, sigma, completions).max() for i in range(n)])
    return (longest * mean_s / longest.mean()).tolist()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def run_one(k: int, rollout_s: float, train_s: float, steps: int, tmp: Path,
            times: Path | None = None, extra: tuple[str, ...] = (), env_extra: dict | None = None,
            tag: str = "") -> dict:
    """One `areno train` run -> its measured steps' metrics and the hooks' records.
    times: a JSON list of rollout seconds (the tail) instead of rollout_s each;
    extra: more flags; env_extra: more environment; tag: in its directory's name."""
    out = tmp / f"k{k}-r{rollout_s:g}-t{train_s:g}{'-tail' if times else ''}{tag}"
    log = out / "hooks"
    log.mkdir(parents=True)
    cmd = [sys.executable, "-m", "areno.cli", "train", "--rollout-engine", "hf", "--world-size", "1",
           "--rollout-world-size", "1", "--off-policy-steps", str(k), "--max-steps", str(steps),
           "--seed", "0", "--no-save", "--log-completions", "0", "--output-dir", str(out), *extra,
           *([] if "--partial-rollouts" in extra else ["--whole-rounds"])]  # K-ahead: whole rounds
    env = child_env(ARENO_RANK_HOOKS=HOOKS_SPEC, **{ROLLOUT_ENV: str(rollout_s), TRAIN_ENV: str(train_s),
                                                   LOG_ENV: str(log), **({TIMES_ENV: str(times)} if times else {}),
                                                   **(env_extra or {})})
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    recs = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step" in r]
    measured = [r for r in recs if r["step"] > min(WARMUP, steps - 1)]  # at least the last step
    return {"k": k, "rollout_s": rollout_s, "train_s": train_s, "run_s": time.perf_counter() - t0,
            "steps": measured, "train_cmds": read_jsonl(log / "train0.jsonl"),
            "rollout_cmds": read_jsonl(log / "rollout0.jsonl")}  # engine process 0


def med(run: dict, key: str) -> float:
    return float(np.median([r.get(key, 0.0) for r in run["steps"]]))


def period(run: dict) -> float:
    """Median seconds between the starts of consecutive measured train commands:
    the step as the rank sees it, the controller's work between steps included."""
    t = [c["t"] for c in run["train_cmds"]][-len(run["steps"]) - 1:]
    return float(np.median(np.diff(t))) if len(t) > 1 else float("nan")


def mean(run: dict, key: str) -> float:
    return float(np.mean([r.get(key, 0.0) for r in run["steps"]]))


def summarize(name: str, runs: dict[int, dict], rollout_mean_s: float) -> dict:
    """One scenario's row per K, from its runs by K: mean step time against the
    ideal max(mean R, T) + sync and against K = 1, and where the rest went."""
    T = next(iter(runs.values()))["train_s"]
    sync = float(np.median([med(r, "time/weight_sync") for k, r in runs.items() if k >= 1]))
    ideal = max(rollout_mean_s, T) + sync
    k1 = mean(runs[1], "time/step") if 1 in runs else float("nan")
    rows = []
    for k, r in sorted(runs.items()):
        step = mean(r, "time/step")
        cmds = r["rollout_cmds"] + r["train_cmds"]
        rows.append({"scenario": name, "k": k, "rollout_mean_s": rollout_mean_s, "train_s": T,
                     "step_s": step, "median_step_s": med(r, "time/step"), "sync_s": sync, "ideal_s": ideal,
                     "over_ideal": step / ideal, "over_k1": step / k1,
                     "wait_batch_s": mean(r, "time/wait_batch"), "wait_weights_s": mean(r, "time/wait_weights"),
                     "lag_mean": mean(r, "rollout/policy_lag_mean"), "period_s": period(r),
                     "max_overrun_s": max((c["work_s"] - c["cost_s"] for c in cmds), default=0.0),
                     "train_cmds": len(r["train_cmds"]), "rollout_cmds": len(r["rollout_cmds"]),
                     "measured_steps": len(r["steps"]), "step_times_s": [x["time/step"] for x in r["steps"]]})
    return {"name": name, "rows": rows}


def table(scenarios: list[dict]) -> str:
    out = ["| scenario | K | mean R | T | step (mean) | step (median) | ideal | step/ideal | step/K=1 "
           "| wait_batch | lag |", "| --- " * 11 + "|"]
    for sc in scenarios:
        for r in sc["rows"]:
            out.append(f"| {sc['name']} | {r['k']} | {r['rollout_mean_s']:.3g} s | {r['train_s']:g} s | "
                       f"{r['step_s']:.3f} s | {r['median_step_s']:.3f} s | {r['ideal_s']:.3f} s | "
                       f"{r['over_ideal']:.2f} | {r['over_k1']:.2f} | {1e3 * r['wait_batch_s']:.0f} ms | "
                       f"{r['lag_mean']:.2f} |")
    return "\n".join(out)


def misses(scenarios: list[dict]) -> list[str]:
    """The targets of the module docstring that a scenario missed."""
    out = []
    for sc in scenarios:
        by_k = {r["k"]: r for r in sc["rows"]}
        if sc["name"] == "tail":
            if 1 in by_k and 4 in by_k and by_k[4]["step_s"] >= by_k[1]["step_s"]:
                out.append(f"tail: K=4 {by_k[4]['step_s']:.3f} s not below K=1 {by_k[1]['step_s']:.3f} s")
            continue
        if 1 in by_k and by_k[1]["over_ideal"] > TARGET_IDEAL:
            out.append(f"{sc['name']}: K=1/ideal {by_k[1]['over_ideal']:.2f} > {TARGET_IDEAL}")
        if sc["name"] == "R/T 1" and 0 in by_k and 1 in by_k:
            ratio = by_k[1]["step_s"] / by_k[0]["step_s"]
            if ratio > TARGET_SYNC_RATIO + 0.05:
                out.append(f"R/T 1: K=1/K=0 {ratio:.2f} > {TARGET_SYNC_RATIO} + 0.05")
    return out


DEMO_MODES = {"colocated K=0": [], "split K=0": ["--rollout-world-size", "1"],
              "split K=1": ["--rollout-world-size", "1", "--off-policy-steps", "1", "--whole-rounds"]}


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


def side_mode(args: argparse.Namespace) -> tuple[str, dict] | None:
    """The partial-rollout comparisons and the demo table (each a mode of its own)
    -> (what to print, the JSON to write), or None for the fixed/tail scenarios."""
    if args.partial_smol:
        from arenobench.partial_smol import partial_smol

        with tempfile.TemporaryDirectory(prefix="areno-async-smol-") as d:
            text, rows = partial_smol(args, Path(d))
        return text, {"partial_smol": rows}
    if args.partial_real:
        from arenobench.partial_real import partial_real

        with tempfile.TemporaryDirectory(prefix="areno-async-partial-") as d:
            text, rows = partial_real(args.partial_k, args.train_s, args.tail_steps, args.tail_ratio,
                                      args.tail_completions, args.tail_sigma, Path(d))
        return text, {"partial_real": rows}
    if args.partial:
        from arenobench.partial_sim import partial_report

        text, rows = partial_report(args.partial_k, args.tail_sigma, args.partial_steps)
        return text, {"partial": rows}
    if args.demo:
        with tempfile.TemporaryDirectory(prefix="areno-async-demo-") as d:
            return demo_table(args.demo_steps, Path(d)), {}
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-s", type=float, default=0.5, help="T: seconds per train command")
    ap.add_argument("--ratios", default="0.5,1,2", help="R/T values of fixed rollout times, comma-separated")
    ap.add_argument("--ks", default="0,1,2,4", help="--off-policy-steps values, comma-separated")
    ap.add_argument("--steps", type=int, default=10, help="steps per fixed run (the first %d are warm-up)" % WARMUP)
    ap.add_argument("--tail-steps", type=int, default=60, help="steps per tail run")
    ap.add_argument("--tail-ratio", type=float, default=0.8, help="the tail's mean R / T")
    ap.add_argument("--tail-completions", type=int, default=16, help="completions per rollout in the tail")
    ap.add_argument("--tail-sigma", type=float, default=1.5, help="the tail's lognormal sigma")
    ap.add_argument("--no-tail", action="store_true", help="fixed rollout times only")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--demo", action="store_true", help="the embedded demo colocated, split K=0, split K=1")
    ap.add_argument("--demo-steps", type=int, default=600, help="steps of each demo run (default: the demo's)")
    ap.add_argument("--partial", action="store_true",
                    help="simulated: sync (K=0), K-ahead and partial rollouts at --partial-k on the long-tail "
                         "workloads, side by side (arenobench/partial_sim.py; no areno run)")
    ap.add_argument("--partial-k", type=int, default=2, help="K of the K-ahead and partial modes")
    ap.add_argument("--partial-steps", type=int, default=20, help="steps of each simulated run")
    ap.add_argument("--partial-real", action="store_true",
                    help="real runs on the tail (stand-ins): K=0, K-ahead and --partial-rollouts at --partial-k, "
                         "side by side (arenobench/partial_real.py)")
    ap.add_argument("--partial-smol", action="store_true",
                    help="the real model (SmolLM2, vLLM CPU engine) on a long-tailed task: K=0, K-ahead and "
                         "--partial-rollouts at --partial-k, side by side (arenobench/partial_smol.py)")
    ap.add_argument("--smol-steps", type=int, default=8, help="steps of each --partial-smol run")
    ap.add_argument("--prompts", type=int, default=8, help="--batch-size of the --partial-smol runs")
    ap.add_argument("--samples", type=int, default=4, help="--n-samples of the --partial-smol runs")
    ap.add_argument("--new-tokens", type=int, default=160, help="--max-new-tokens of the --partial-smol runs")
    ap.add_argument("--long-every", type=int, default=4, help="--partial-smol: one prompt in this many is long")
    ap.add_argument("--smol-engine", choices=("vllm", "hf"), default="vllm",
                    help="--partial-smol's rollout engine (hf: transformers, where generation is the slower side)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "areno-bench-cache",
                    help="where --partial-smol builds the real model once")
    args = ap.parse_args(argv)
    side = side_mode(args)
    if side is not None:
        text, rows = side
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=1))
        return 0
    if args.steps < 1 or args.train_s <= 0:
        ap.error("--steps must be >= 1 and --train-s > 0")
    ks = [int(x) for x in args.ks.split(",") if x]
    T = args.train_s
    plans = [(f"R/T {r:g}", r * T, None, args.steps) for r in (float(x) for x in args.ratios.split(",") if x)]
    scenarios = []
    with tempfile.TemporaryDirectory(prefix="areno-async-") as d:
        if not args.no_tail:
            times = tail_times(args.tail_steps + max(ks) + 2, args.tail_ratio * T, args.tail_completions,
                               args.tail_sigma)
            (Path(d) / "tail.json").write_text(json.dumps(times))
            plans.append(("tail", float(np.mean(times)), Path(d) / "tail.json", args.tail_steps))
            print(f"  tail: rollout times mean {np.mean(times):.3f} s, median {np.median(times):.3f} s, "
                  f"p90 {np.quantile(times, 0.9):.3f} s, max {max(times):.3f} s (T = {T:g} s)", flush=True)
        for name, R, times_file, steps in plans:
            runs = {k: run_one(k, R, T, steps, Path(d), times_file) for k in ks}
            scenarios.append(summarize(name, runs, R))
            print(f"  {name}: " + ", ".join(f"K={r['k']} {r['step_s']:.3f} s" for r in scenarios[-1]["rows"])
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nmean time/step over the steps after the first {WARMUP}; ideal = max(mean R, T) + sync "
          "(the K >= 1 runs' time/weight_sync)\n")
    print(table(scenarios))
    missed = misses(scenarios)
    print("\ntargets: " + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"scenarios": scenarios, "load": os.getloadavg()[0]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
