"""The demo's step idle and next to one busy process, for the default threads
and for `--cpu-threads 1`: medians of time/step, time/train and time/rollout, the
step's p90 and the loaded/idle ratio.

The busy process is a pure-Python spin loop pinned to nothing (a laptop's other
work). The conditions are interleaved round by round (idle, busy, idle, ...), so
a neighbour's load on a shared host falls on all of them alike. The first
WARMUP steps of a run (allocator, first generate) are left out.

    python scripts/bench_busy.py --steps 150 --rounds 2
    python scripts/bench_busy.py --variant "passive=--cpu-threads 2|OMP_WAIT_POLICY=PASSIVE"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10
SPIN = "while True: pass"
KEYS = ("time/step", "time/train", "time/rollout")  # the columns step_times returns


def parse_variant(text: str) -> tuple[str, list[str], dict[str, str]]:
    """'name=--flag v ...|K=V,K2=V2' -> (name, flags, env)."""
    name, _, rest = text.partition("=")
    flags, _, env = rest.partition("|")
    return name, flags.split(), dict(kv.split("=", 1) for kv in env.split(",") if kv)


def step_times(flags: list[str], env: dict[str, str], steps: int, tmp: Path, warmup: int = WARMUP,
               key: str = "time/step") -> np.ndarray:
    """[steps - warmup] float64 seconds: `key` (time/step, time/train, ...) of one demo run."""
    out = tmp / f"run{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "areno.cli", "train", "--max-steps", str(steps), "--no-save",
           "--log-completions", "0", "--output-dir", str(out), *flags]
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return np.array([[r.get(k, np.nan) for k in KEYS] for r in recs if "time/step" in r][warmup:])


def measure(variants: list[tuple[str, list[str], dict[str, str]]], steps: int, rounds: int,
            warmup: int = WARMUP, conditions: tuple[str, ...] = ("idle", "busy"),
            ) -> dict[tuple[str, str], np.ndarray]:
    """(variant, 'idle' | 'busy') -> [steps, len(KEYS)] seconds of its runs."""
    got: dict[tuple[str, str], list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory(prefix="areno-busy-") as d:
        for _ in range(rounds):
            for name, flags, env in variants:
                for cond in conditions:
                    spin = subprocess.Popen([sys.executable, "-c", SPIN]) if cond == "busy" else None
                    try:
                        t = step_times(flags, env, steps, Path(d), warmup)
                        got.setdefault((name, cond), []).append(t)
                        med = 1e3 * np.nanmedian(t, axis=0)
                        print(f"  {name} {cond}: median step {med[0]:.0f} ms, train {med[1]:.0f}, rollout "
                              f"{med[2]:.0f} (load {os.getloadavg()[0]:.1f})", flush=True)
                    finally:
                        if spin is not None:
                            spin.kill()
                            spin.wait()
    return {k: np.concatenate(v) for k, v in got.items()}


def table(times: dict[tuple[str, str], np.ndarray], names: list[str]) -> str:
    """Median ms of step / train / rollout per condition, and busy/idle of the step."""
    conds = [c for c in ("idle", "busy") if any(k[1] == c for k in times)]
    head = " | ".join(f"{c} step | {c} train | {c} rollout | {c} step p90" for c in conds)
    rows = [f"| variant | {head} |" + (" busy/idle (step) |" if len(conds) == 2 else ""),
            "| --- " * (1 + 4 * len(conds) + (len(conds) == 2)) + "|"]
    for name in names:
        cells, med = [], {}
        for c in conds:
            t = times[(name, c)]
            med[c] = np.nanmedian(t, axis=0)
            cells += [f"{1e3 * v:.0f}" for v in med[c]] + [f"{1e3 * np.percentile(t[:, 0], 90):.0f}"]
        ratio = f" {med['busy'][0] / med['idle'][0]:.2f} |" if len(conds) == 2 else ""
        rows.append(f"| {name} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="demo steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant and condition")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="first steps of a run left out")
    ap.add_argument("--only-variants", action="store_true", help="run only the --variant ones")
    ap.add_argument("--idle-only", action="store_true", help="no busy neighbour runs")
    ap.add_argument("--variant", action="append", default=[],
                    help="an extra variant, 'name=FLAGS|ENV=V,...' (see the examples above)")
    args = ap.parse_args(argv)
    variants = [("default", [], {}), ("--cpu-threads 1", ["--cpu-threads", "1"], {}),
                ("--cpu-threads 2", ["--cpu-threads", "2"], {})]  # 2: the default before issue 17
    variants = [] if args.only_variants else variants
    variants += [parse_variant(v) for v in args.variant]
    print(f"host: {len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f} at the start", flush=True)
    conds = ("idle",) if args.idle_only else ("idle", "busy")
    times = measure(variants, args.steps, args.rounds, args.warmup, conds)
    print(table(times, [v[0] for v in variants]))
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
