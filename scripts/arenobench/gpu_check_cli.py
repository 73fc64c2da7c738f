"""Helpers for scripts/gpu_check.sh's CLI part: build a Qwen3-0.6B-shaped random
model with a tiny prompt set and reward plugin, and summarise an `areno train`
run directory (median seconds per phase, weight sync, peak GPU memory, reward).

    python scripts/gpu_check_cli.py build DIR [--cpu-smoke]   # DIR/model, DIR/prompts.jsonl, DIR/reward.py
    python scripts/gpu_check_cli.py summary RUN_DIR --title T --log LOG --steps N --json OUT.json
        # prints a few lines and writes them as JSON; exit 1 if the run is broken
    python scripts/gpu_check_cli.py table OUT_DIR --out OUT_DIR/gpu_check_table.md
        # one markdown table of every step in steps.jsonl with its run's figures
        # (cli_<name>.json) and the --grad-checkpointing peak memory against the run
        # without; exit 1 if a step failed

The weight-sync check is read from the run itself: areno checks every sync
(exact fingerprint; log-prob probe when due) and stops the run with a
WeightSyncError line otherwise, so a run that logged all N steps and whose log
has no such line passed N checks; any sync/probe metric the run logged is
quoted as well.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# Rewards the fraction of even characters: synthetic, the run measures the machinery.
REWARD = "def reward_fn(r):\n    s = r.completion\n    return sum(ord(c) % 2 == 0 for c in s) / max(len(s), 1)\n"
# How a failed sync check shows in the run's output (the error's type; the command's name).
SYNC_FAILURES = ("WeightSyncError", "sync_weights: rank")
PHASES = ("rollout", "reward", "materialize", "train", "weight_sync", "step")
# Step 1's K = 0 ratio, taken before any update: kernel noise only (docs/PERFORMANCE.md).
RATIO_KEYS = ("train/clip_frac", "train/ratio_std", "train/ratio_max", "train/logprob_diff", "train/tis_weight")


def build(out: Path, smoke: bool) -> None:
    from arenobench.gpu_check import QWEN3_06B, TINY, build_model_dir

    out.mkdir(parents=True, exist_ok=True)
    build_model_dir(TINY if smoke else QWEN3_06B, "cpu" if smoke else "cuda", out / "model")
    rng = np.random.default_rng(0)
    words = ["apple", "river", "seven", "blue", "stone", "quick", "light", "north"]
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, 12)), "answer": str(i)}) + "\n")
    (out / "reward.py").write_text(REWARD)
    # The demo's eval set (its task's own rows), and the config that takes the sampler's old log-probs.
    (out / "demo_eval.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                                 for a, b in ((1, 2), (3, 4), (0, 5), (2, 2), (6, 1))))
    (out / "sampler_logprobs.yaml").write_text("recompute_logprobs: false\n")


def summary(run_dir: Path, title: str, log: Path | None = None, want_steps: int | None = None,
            json_out: Path | None = None) -> bool:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.is_file() else []
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        print(f"== {title}: no step finished")
        if json_out is not None:
            json_out.write_text(json.dumps({"title": title, "steps": 0, "ok": False}) + "\n")
        return False
    steady = steps[1:] or steps
    med = {p: float(np.median([r.get(f"time/{p}", 0.0) for r in steady])) for p in PHASES}
    print(f"== {title}: {len(steps)} steps; median seconds per steady step (step 1 excluded):")
    print("   " + "  ".join(f"{p} {v:.3f}" for p, v in med.items()))
    out: dict = {"title": title, "steps": len(steps), "median_s": med}
    peak = [r["perf/peak_gpu_mem_gb"] for r in steps if "perf/peak_gpu_mem_gb" in r]
    if peak:
        out["peak_gpu_mem_gb"] = peak
        print(f"   peak GPU memory of a rank per train phase: {', '.join(f'{p:.2f}' for p in peak)} GiB")
    for key in ("perf/train_tokens_per_s", "perf/mfu"):
        vals = [r[key] for r in steady if key in r]
        if vals:
            out[key] = float(np.median(vals))
            print(f"   {key}: median {np.median(vals):.4g}")
    rewards = [r["reward/mean"] for r in steps]
    k = min(20, max(1, len(rewards) // 2))
    print(f"   reward: first {k} steps {np.mean(rewards[:k]):.3f}, last {k} steps {np.mean(rewards[-k:]):.3f}")
    out["step1"] = {k: steps[0][k] for k in RATIO_KEYS if k in steps[0]}
    print("   step 1 before any update: " + ", ".join(f"{k[6:]} {v:.4g}" for k, v in out["step1"].items()))
    evals = {k: v for r in rows for k, v in r.items() if k.startswith("eval/")}
    if evals:
        out["eval"] = evals
        print("   eval: " + ", ".join(f"{k} {v:.3g}" for k, v in evals.items()))
    numbers = [r["step"] for r in steps]
    ok = numbers == list(range(1, len(steps) + 1))  # a resumed run goes on where it stopped
    ok &= all(np.isfinite(r.get("train/loss", 0.0)) for r in steps)
    sync = sync_check(steps, log, want_steps)
    out["weight_sync_check"] = sync
    print(f"   weight sync check: {sync['verdict']}")
    ok &= sync["passed"]
    if json_out is not None:
        json_out.write_text(json.dumps(out | {"ok": ok}, indent=1) + "\n")
    return ok


def sync_check(steps: list[dict], log: Path | None, want_steps: int | None) -> dict:
    """The run's own verdict on its weight syncs (see the module docstring)."""
    text = log.read_text(errors="replace") if log is not None and log.is_file() else ""
    failed = [ln.strip() for ln in text.splitlines() if any(m in ln for m in SYNC_FAILURES)]
    logged = {k: [r[k] for r in steps if k in r] for k in sorted({k for r in steps for k in r})
              if "probe" in k or k.startswith("sync/")}
    done = len(steps) if want_steps is None else min(len(steps), want_steps)
    passed = not failed and (want_steps is None or len(steps) >= want_steps)
    verdict = (f"passed at all {done} syncs" if passed else
               f"FAILED: {failed[0][:300] if failed else f'{len(steps)} of {want_steps} steps ran'}")
    if logged:
        verdict += "; " + ", ".join(f"{k} max {max(v):.3g}" for k, v in logged.items())
    return {"passed": passed, "verdict": verdict, "syncs": done, "metrics": logged, "failure": failed[:1]}


def table(out_dir: Path, out: Path) -> bool:
    """Every step of steps.jsonl, joined with its run's summary, as one table."""
    steps = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines() if line]
    lines = ["| step | rc | seconds | limit | steps | median step s | train s | weight sync s | "
             "peak GPU GiB | weight sync check |", "|" + " --- |" * 10]
    runs: dict[str, dict] = {}
    for s in steps:
        run = {}
        if s["step"].startswith("cli_") and (out_dir / f"{s['step']}.json").is_file():
            run = runs[s["step"]] = json.loads((out_dir / f"{s['step']}.json").read_text())
        med = run.get("median_s", {})
        peak = max(run["peak_gpu_mem_gb"]) if run.get("peak_gpu_mem_gb") else None
        cells = [s["step"], s["rc"], s["seconds"], s["limit_s"], run.get("steps", ""),
                 _num(med.get("step")), _num(med.get("train")), _num(med.get("weight_sync")), _num(peak),
                 run.get("weight_sync_check", {}).get("verdict", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", grad_checkpointing_line(runs.get("cli_qwen3"), runs.get("cli_qwen3_ckpt")),
              ratio_line(runs.get("cli_qwen3"), runs.get("cli_qwen3_ckpt"))]
    total = sum(s["seconds"] for s in steps)
    ok = all(s["rc"] == 0 for s in steps) and all(r.get("ok") for r in runs.values())
    lines.append(f"{len(steps)} steps in {total} s; {'ALL PASS' if ok else 'FAILED'}")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok


def grad_checkpointing_line(plain: dict | None, ckpt: dict | None) -> str:
    """The peak memory of a train phase with --grad-checkpointing against the same run without."""
    if not plain or not ckpt:
        return "grad checkpointing: a run is missing"
    if not plain.get("peak_gpu_mem_gb") or not ckpt.get("peak_gpu_mem_gb"):
        return "grad checkpointing: no GPU peak memory (CPU)"
    a, b = max(plain["peak_gpu_mem_gb"]), max(ckpt["peak_gpu_mem_gb"])
    return f"grad checkpointing: peak {b:.2f} GiB against {a:.2f} GiB without ({b / a:.2f}x)"


def ratio_line(trainer: dict | None, sampler: dict | None) -> str:
    """Step 1's K = 0 ratio with the trainer's old log-probs (the bf16 default) against
    the sampler's, on the same model, seed and prompts (docs/PERFORMANCE.md)."""
    if not trainer or not sampler:
        return "K = 0 ratio at step 1: a run is missing"

    def fmt(run: dict) -> str:
        return ", ".join(f"{k[6:]} {run['step1'][k]:.4g}" for k in RATIO_KEYS if k in run.get("step1", {}))
    return f"K = 0 ratio at step 1: trainer's old log-probs {fmt(trainer)}; sampler's {fmt(sampler)}"


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dir")
    b.add_argument("--cpu-smoke", action="store_true")
    s = sub.add_parser("summary")
    s.add_argument("run_dir")
    s.add_argument("--title", default="run")
    s.add_argument("--log", type=Path, default=None, help="the run's terminal output")
    s.add_argument("--steps", type=int, default=None, help="steps the run was asked for")
    s.add_argument("--json", type=Path, default=None, help="write the summary here")
    t = sub.add_parser("table")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "table":
        return 0 if table(args.out_dir, args.out) else 1
    if args.cmd == "build":
        build(Path(args.dir), args.cpu_smoke)
        return 0
    return 0 if summary(Path(args.run_dir), args.title, args.log, args.steps, args.json) else 1


if __name__ == "__main__":
    sys.exit(main())
