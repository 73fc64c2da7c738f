"""`bench_async.py --partial-smol`: issue 39's comparison on the real model.

SmolLM2-135M-Instruct (arenobench/smol.py), fp32, the vLLM CPU engine
(--smol-engine hf: transformers') in one engine process beside one rank, run four ways on one long-tailed task, side
by side in one invocation: synchronous (K = 0), K-ahead (K = --partial-k),
--partial-rollouts at the same K, and the same with --cut-at-deadline. The task mixes short answers with long ones
(`tail_task`: most prompts ask for a sum, one in --long-every asks to count up
to a number drawn from a heavy tail), so a round's slowest group runs many
times longer than its median one, as on long chain-of-thought work. The
lengths are the model's own (EOS), capped by --max-new-tokens; the table
quotes what they were (response/len_mean and _max).

Per mode: the median over steps after the first two (engine and kernel
warm-ups) of time/step, trained tokens per second (train/loss_tokens /
time/step), the engines' idle fraction (time/wait_weights: the seconds an
engine had nothing to generate, over the step) and the token lag. Ratios are
against K = 0 of the same invocation. On 2 CPU cores the rank and the engine
share the cores, so the ratio is what a CPU can show, not a GPU's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from arenobench.lib import child_env

REWARD_SRC = (
    "def reward_fn(record):\n"
    "    return float(record.answer in record.completion) - 0.001 * len(record.completion)\n"
)
SKIP = 2  # warm-up steps left out of the medians


def tail_task(d: Path, rows: int, long_every: int, sigma: float, seed: int = 0) -> tuple[Path, Path]:
    """A jsonl of `rows` prompts and its reward plugin: sums (a few tokens each)
    and, one row in long_every, counting to a lognormal(sigma) number (the tail)."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(rows):
        if i % long_every == long_every - 1:
            n = int(min(200, 8 * rng.lognormal(0.0, sigma)) + 3)
            lines.append({"prompt": f"Count from 1 to {n}, separated by commas.", "answer": str(n)})
        else:
            a, b = 1 + (7 * i) % 50, 1 + (13 * i) % 50
            lines.append({"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)})
    data, reward = d / "tail.jsonl", d / "tail_reward.py"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    reward.write_text(REWARD_SRC)
    return data, reward


def run_mode(model: Path, data: Path, reward: Path, k: int, flags: list[str], args, out: Path) -> list[dict]:
    """One `areno train` run -> its step records (metrics.jsonl)."""
    cmd = [sys.executable, "-m", "areno.cli", "train", "--ckpt", str(model), "--dataset-path", str(data),
           "--reward-fn-path", str(reward), "--system-prompt", "Answer briefly.", "--dtype", "float32",
           "--rollout-engine", args.smol_engine, "--world-size", "1", "--rollout-world-size", "1",
           "--off-policy-steps", str(k), "--batch-size", str(args.prompts), "--n-samples", str(args.samples),
           "--max-new-tokens", str(args.new_tokens), "--max-steps", str(args.smol_steps), "--seed", "0",
           "--reward-workers", "0", "--log-completions", "0", "--no-save", "--output-dir", str(out), *flags]
    res = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in recs if "time/step" in r]


def summary(name: str, steps: list[dict]) -> dict:
    """Medians over the measured steps of one mode."""
    kept = steps[SKIP:] or steps[-1:]

    def med(key: str) -> float:
        return float(statistics.median(r.get(key, 0.0) for r in kept))

    step = med("time/step")
    return {"mode": name, "step_s": step, "trained_tokens_per_s": med("train/loss_tokens") / step,
            "engine_idle_frac": med("time/wait_weights") / step, "token_lag_mean": med("rollout/token_lag_mean"),
            "len_mean": med("response/len_mean"), "len_max": max(r.get("response/len_max", 0.0) for r in kept),
            "inflight_loads": med("rollout/inflight_loads"),
            "cut_samples": sum(r.get("rollout/cut_samples", 0.0) for r in steps), "measured_steps": len(kept)}


def partial_smol(args, tmp: Path) -> tuple[str, list[dict]]:
    """The four runs -> (a markdown table, its rows)."""
    from arenobench.smol import smol_model_path

    model = smol_model_path(args.cache)
    data, reward = tail_task(tmp, args.prompts * (args.smol_steps + args.partial_k + 2), args.long_every,
                             args.tail_sigma)
    k = args.partial_k
    rows = []
    for name, kk, flags in [("sync (K=0)", 0, ["--whole-rounds"]), (f"K-ahead (K={k})", k, ["--whole-rounds"]),
                            (f"partial (K={k})", k, ["--partial-rollouts"]),
                            (f"partial, cut at deadline (K={k})", k, ["--partial-rollouts", "--cut-at-deadline"])]:
        where = tmp / name.split(" (")[0].replace(", ", "-").replace(" ", "-")
        rows.append(summary(name, run_mode(model, data, reward, kk, flags, args, where)))
        print(f"  {name}: {rows[-1]['step_s']:.2f} s/step", flush=True)
    sync = rows[0]["trained_tokens_per_s"]
    out = ["| mode | step (median) | trained tok/s | vs sync | engine idle | token lag | len mean / max "
           "| in-flight loads/step | samples cut |", "| --- " * 9 + "|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['step_s']:.2f} s | {r['trained_tokens_per_s']:.0f} | "
                   f"{r['trained_tokens_per_s'] / sync:.2f}x | {100 * r['engine_idle_frac']:.0f}% | "
                   f"{r['token_lag_mean']:.2f} | {r['len_mean']:.0f} / {r['len_max']:.0f} | "
                   f"{r['inflight_loads']:.1f} | {r['cut_samples']:.0f} |")
    return "\n".join(out), rows
