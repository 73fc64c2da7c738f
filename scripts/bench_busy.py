"""The demo's step idle and next to one busy process, for the default threads
and for `--cpu-threads 1`: median / p90 of time/step and the loaded/idle ratio.

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


def parse_variant(text: str) -> tuple[str, list[str], dict[str, str]]:
    """'name=--flag v ...|K=V,K2=V2' -> (name, flags, env)."""
    name, _, rest = text.partition("=")
    flags, _, env = rest.partition("|")
    return name, flags.split(), dict(kv.split("=", 1) for kv in env.split(",") if kv)


def step_times(flags: list[str], env: dict[str, str], steps: int, tmp: Path) -> np.ndarray:
    """[steps - WARMUP] float64 seconds: time/step of one demo run."""
    out = tmp / f"run{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "areno.cli", "train", "--max-steps", str(steps), "--no-save",
           "--log-completions", "0", "--output-dir", str(out), *flags]
    res = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return np.array([r["time/step"] for r in recs if "time/step" in r][WARMUP:])


def measure(variants: list[tuple[str, list[str], dict[str, str]]], steps: int, rounds: int
            ) -> dict[tuple[str, str], np.ndarray]:
    """(variant, 'idle' | 'busy') -> every step time of its runs."""
    got: dict[tuple[str, str], list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory(prefix="areno-busy-") as d:
        for _ in range(rounds):
            for name, flags, env in variants:
                for cond in ("idle", "busy"):
                    spin = subprocess.Popen([sys.executable, "-c", SPIN]) if cond == "busy" else None
                    try:
                        t = step_times(flags, env, steps, Path(d))
                        got.setdefault((name, cond), []).append(t)
                        print(f"  {name} {cond}: median {1e3 * np.median(t):.0f} ms "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
                    finally:
                        if spin is not None:
                            spin.kill()
                            spin.wait()
    return {k: np.concatenate(v) for k, v in got.items()}


def table(times: dict[tuple[str, str], np.ndarray], names: list[str]) -> str:
    rows = ["| threads | idle median | idle p90 | busy median | busy p90 | busy/idle (median) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        idle, busy = times[(name, "idle")], times[(name, "busy")]
        mi, mb = np.median(idle), np.median(busy)
        rows.append(f"| {name} | {1e3 * mi:.0f} ms | {1e3 * np.percentile(idle, 90):.0f} ms | "
                    f"{1e3 * mb:.0f} ms | {1e3 * np.percentile(busy, 90):.0f} ms | {mb / mi:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="demo steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per variant and condition")
    ap.add_argument("--variant", action="append", default=[],
                    help="an extra variant, 'name=FLAGS|ENV=V,...' (see the examples above)")
    args = ap.parse_args(argv)
    variants = [("default", [], {}), ("--cpu-threads 1", ["--cpu-threads", "1"], {}),
                ("--cpu-threads 2", ["--cpu-threads", "2"], {})]  # 2: the default before issue 17
    variants += [parse_variant(v) for v in args.variant]
    print(f"host: {len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f} at the start", flush=True)
    times = measure(variants, args.steps, args.rounds)
    print(table(times, [v[0] for v in variants]))
    print(f"load {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
