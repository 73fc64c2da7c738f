"""LoRA against full fine-tuning on the real model, same task, steps and seed
(issue 26, 3, "Does LoRA learn?"): scripts/bench_lora_vs_full.py's library.

The task is the embedded demo's (areno/data/tasks/arith.py: `a+b=` with a+b < 10,
reward 1.0 for the right digit then end of sequence, 0.5 for the right digit then
more) given to SmolLM2-135M-Instruct through its chat template: the model knows
the sums but answers in sentences ("3+4=7", "The answer is 7."): reward ~0.02
at the start. With the system prompt "Reply with the number only." it answers
with the digit more often, and what it must learn in a few dozen steps is to
answer with the digit alone, then stop. Each arm is one `areno train` process (a fresh engine and trainer,
the same --seed, hence the same prompts per step); the curve is its metrics.jsonl
`reward/mean` per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Arm:
    """One run of a comparison: its name, --lora-rank (0: full FT), --lr and any
    further flags (placement, K)."""

    name: str
    lora_rank: int
    lr: float
    flags: tuple[str, ...] = ()


def write_task(path: Path) -> Path:
    """The demo's 55 rows as a .jsonl dataset (prompt, answer) at `path`."""
    from areno.data.tasks.arith import rows

    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    return path


def add_task_args(ap: argparse.ArgumentParser) -> None:
    """The options every comparison on this task shares: the batch, the answer's
    tokens, the summary's window, where the model comes from."""
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "areno")
    ap.add_argument("--model", type=Path, default=None, help="another HF model dir (tests: tiny chat)")


SYSTEM_PROMPT = "Reply with the number only."  # without it the model answers in sentences: reward ~0


def train_args(model: Path, data: Path, out: Path, arm: Arm, steps: int, seed: int, batch_size: int,
               n_samples: int, max_new_tokens: int, engine: str, threads: int) -> list[str]:
    """The `areno train` command line of one arm (epochs unbounded: --max-steps ends it)."""
    args = [sys.executable, "-m", "areno.cli", "train", "--ckpt", str(model), "--dataset-path", str(data),
            "--reward-fn-path", "builtin:arith", "--max-steps", str(steps), "--seed", str(seed),
            "--batch-size", str(batch_size), "--n-samples", str(n_samples),
            "--max-new-tokens", str(max_new_tokens), "--lr", f"{arm.lr:g}", "--warmup-steps", "0",
            "--dtype", "float32", "--rollout-engine", engine, "--cpu-threads", str(threads),
            "--system-prompt", SYSTEM_PROMPT, "--epochs", "1000", "--no-save", "--output-dir", str(out)]
    return args + (["--lora-rank", str(arm.lora_rank)] if arm.lora_rank else []) + list(arm.flags)


def rewards_of(run_dir: Path) -> list[float]:
    """metrics.jsonl -> reward/mean per step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [float(r["reward/mean"]) for r in map(json.loads, lines) if "reward/mean" in r]


def run_arm(args: list[str], run_dir: Path) -> dict:
    """Run one arm to the end; -> {"rewards": [...], "seconds": wall}. RuntimeError
    with the log's tail if it fails."""
    t0 = time.perf_counter()
    res = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ))
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:5])} exited {res.returncode}:\n{res.stdout[-1500:]}{res.stderr[-3000:]}")
    return {"rewards": rewards_of(run_dir), "seconds": time.perf_counter() - t0}


def curve_summary(rewards: list[float], window: int) -> dict:
    """First / last `window` steps' mean reward and the best `window`-step mean."""
    r = np.asarray(rewards, dtype=np.float64)
    w = min(window, r.size)
    means = np.convolve(r, np.ones(w) / w, mode="valid")
    return {"first": float(r[:w].mean()), "last": float(r[-w:].mean()), "best": float(means.max()),
            "best_end_step": int(means.argmax()) + w}


def side_by_side(curves: dict[str, list[float]], every: int) -> list[str]:
    """A table of the arms' mean reward per block of `every` steps."""
    names = list(curves)
    steps = max(len(c) for c in curves.values())
    lines = [f"{'steps':>9} " + " ".join(f"{n:>10}" for n in names)]
    for lo in range(0, steps, every):
        cells = [f"{np.mean(c[lo:lo + every]):>10.3f}" if lo < len(c) else f"{'':>10}" for c in curves.values()]
        lines.append(f"{lo + 1:>4}-{min(lo + every, steps):<4} " + " ".join(cells))
    return lines
