"""Helpers for scripts/gpu_check.sh's CLI part: build a Qwen3-0.6B-shaped random
model with a tiny prompt set and reward plugin, and summarise an `areno train`
run directory (median seconds per phase, weight sync, peak GPU memory, reward).

    python scripts/gpu_check_cli.py build DIR [--cpu-smoke]   # DIR/model, DIR/prompts.jsonl, DIR/reward.py
    python scripts/gpu_check_cli.py summary RUN_DIR --title T   # prints a few lines; exit 1 if the run is broken
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Rewards the fraction of even characters: synthetic, the run measures the machinery.
REWARD = "def reward_fn(r):\n    s = r.completion\n    return sum(ord(c) % 2 == 0 for c in s) / max(len(s), 1)\n"
PHASES = ("rollout", "reward", "materialize", "train", "weight_sync", "step")


def build(out: Path, smoke: bool) -> None:
    from gpu_check import QWEN3_06B, TINY, build_model_dir

    out.mkdir(parents=True, exist_ok=True)
    build_model_dir(TINY if smoke else QWEN3_06B, "cpu" if smoke else "cuda", out / "model")
    rng = np.random.default_rng(0)
    words = ["apple", "river", "seven", "blue", "stone", "quick", "light", "north"]
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, 12)), "answer": str(i)}) + "\n")
    (out / "reward.py").write_text(REWARD)


def summary(run_dir: Path, title: str) -> bool:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if "time/step" in r]
    steady = steps[1:] or steps
    med = {p: float(np.median([r.get(f"time/{p}", 0.0) for r in steady])) for p in PHASES}
    print(f"== {title}: {len(steps)} steps; median seconds per steady step (step 1 excluded):")
    print("   " + "  ".join(f"{p} {v:.3f}" for p, v in med.items()))
    peak = [r["perf/peak_gpu_mem_gb"] for r in steps if "perf/peak_gpu_mem_gb" in r]
    if peak:
        print(f"   peak GPU memory of a rank: {max(peak):.2f} GiB")
    for key in ("perf/train_tokens_per_s", "perf/mfu"):
        vals = [r[key] for r in steady if key in r]
        if vals:
            print(f"   {key}: median {np.median(vals):.4g}")
    rewards = [r["reward/mean"] for r in steps]
    k = min(20, max(1, len(rewards) // 2))
    print(f"   reward: first {k} steps {np.mean(rewards[:k]):.3f}, last {k} steps {np.mean(rewards[-k:]):.3f}")
    finite = all(np.isfinite(r.get("train/loss", 0.0)) for r in steps)
    return bool(steps) and finite


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--cpu-smoke", action="store_true")
    s = sub.add_parser("summary")
    s.add_argument("run_dir")
    s.add_argument("--title", default="run")
    args = ap.parse_args()
    if args.cmd == "build":
        build(Path(args.dir), args.cpu_smoke)
        return 0
    return 0 if summary(Path(args.run_dir), args.title) else 1


if __name__ == "__main__":
    sys.exit(main())
