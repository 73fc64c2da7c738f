#!/usr/bin/env python
"""Start-up of `areno train`: time to step 1 of the embedded demo, and a
config-level refusal, side by side with TRL's GRPOTrainer on the same task.

  areno      `python -m areno.cli train --max-steps 3 --no-save` (the demo): the
             second from process start at which step 1's line reached
             metrics.jsonl (bench_demo_vs_trl.run_child polls it every 20 ms).
  refusal    `python -m areno.cli train --batch-size 0`: process start to exit
             (exit 2, one line).
  trl        bench_demo_vs_trl's TRL child (the same model, prompts, reward and
             hyper-parameters): the second its first logged step was seen.
  --ref DIR  also areno's demo from another checkout (a `git worktree` of the
             previous commit), alternating with this one, so a change shows
             as a ratio measured in the same run.

Each is run --repeat times (default 3), alternating, and the median is
reported. Without `trl` its row is skipped (bench_demo_vs_trl's INSTALL_HINT
says how to install it aside).

Usage:
  python scripts/bench_startup.py
  python scripts/bench_startup.py --ref /tmp/prev --repeat 5 --json /tmp/startup.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_demo_vs_trl import REPO, run_child


TRACE = "ARENO_STARTUP_TRACE"  # areno.timing.startup_mark's file (a checkout without it writes none)


def milestones(trace: Path, t0: float) -> dict[str, float]:
    """The trace's first mark of each label, in seconds after t0 (unix time)."""
    seen: dict[str, float] = {}
    if trace.exists():
        for line in trace.read_text().splitlines():
            at, _pid, label = line.split(maxsplit=2)
            seen.setdefault(label, float(at) - t0)
    return seen


def areno_step1(repo: Path, out: Path, phases: dict[str, list[float]] | None = None) -> float:
    """Seconds from process start to step 1 of the demo run from checkout `repo`;
    phases: each start-up milestone's seconds are appended there."""
    cmd = [sys.executable, "-m", "areno.cli", "train", "--max-steps", "3", "--seed", "0", "--no-save",
           "--output-dir", str(out)]
    trace = out.parent / f"{out.name}.trace"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
           TRACE: str(trace)}
    wall0 = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.02)
    seen = time.perf_counter() - t0
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"areno ({repo}) exited {proc.returncode}: {err[-2000:]}")
    if phases is not None:
        for label, at in milestones(trace, wall0).items():
            phases.setdefault(label, []).append(at)
        phases.setdefault("step 1 in metrics.jsonl", []).append(seen)
    return seen


def refusal_s() -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--batch-size", "0"], cwd=REPO,
                          capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 2:
        raise SystemExit(f"the refusal exited {proc.returncode}: {proc.stderr[-500:]}")
    return took


def trl_step1(d: Path) -> float:
    row = run_child("trl", [sys.executable, str(REPO / "scripts" / "bench_demo_vs_trl.py"), "--steps", "3",
                            "--seed", "0", "--trl-child", str(d)], d / "trl_steps.jsonl", d / "trl.log")
    return row["first_step_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ref", type=Path, help="another checkout whose demo start-up is measured alongside")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    have_trl = importlib.util.find_spec("trl") is not None
    times: dict[str, list[float]] = {"areno": [], "refusal": []}
    phases: dict[str, list[float]] = {}
    if a.ref:
        times["ref"] = []
    if have_trl:
        times["trl"] = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for i in range(a.repeat):
            d = Path(tmp) / str(i)
            d.mkdir()
            times["areno"].append(areno_step1(REPO, d / "areno", phases))
            if a.ref:
                times["ref"].append(areno_step1(a.ref.resolve(), d / "ref"))
            times["refusal"].append(refusal_s())
            if have_trl:
                times["trl"].append(trl_step1(d))
    med = {k: statistics.median(v) for k, v in times.items()}
    names = {"areno": "areno demo, to step 1", "ref": f"areno demo at {a.ref}, to step 1",
             "refusal": "config refusal (--batch-size 0)", "trl": "TRL GRPOTrainer, to step 1"}
    for k, v in times.items():
        print(f"{names[k]:<45} median {med[k]:6.2f} s   ({', '.join(f'{x:.2f}' for x in v)})")
    if "ref" in med:
        print(f"areno / ref: {med['areno'] / med['ref']:.2f}")
    if "trl" in med:
        print(f"areno / TRL: {med['areno'] / med['trl']:.2f}")
    else:
        print("trl is not importable: its row is skipped (see bench_demo_vs_trl.py's INSTALL_HINT)")
    print("\nareno's start-up, median second of each milestone (controller; peer: the rank):")
    for label, at in sorted(phases.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"  {statistics.median(at):6.2f} s  {label}")
    if a.json:
        a.json.write_text(json.dumps({"times": times, "median": med, "repeat": a.repeat, "phases": phases},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
