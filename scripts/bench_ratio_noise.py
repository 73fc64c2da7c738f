"""The K = 0 importance ratio at step 1, before any update: how far the "old"
log-probs the loss divides by are from the trainer's own, per source of old
log-probs. At K = 0 with one mini-batch and one epoch the policy has not moved
when the ratio is taken, so every clipped token and every ratio != 1 is kernel
noise (the sampler's kernels against the trainer's, in the run's dtype).

    python scripts/bench_ratio_noise.py --ckpt DIR --engine vllm --dtype bfloat16   # docs/PERFORMANCE.md
    python scripts/bench_ratio_noise.py --smoke                                     # CI: the demo model

For each source of old log-probs (sampler: the engine's sampled-token log-probs;
trainer: the trainer's own before the update, the sampler's mismatch as a
truncated-IS weight at --tis-cap 2: the bf16 default) it runs `areno train
--max-steps 1` (no save) on the same seeded prompts and reads step 1's
train/clip_frac, train/ratio_std, train/ratio_max and train/logprob_diff (mean
|trainer - sampler| log-prob per token, the same in both). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KEYS = ("train/clip_frac", "train/ratio_std", "train/ratio_max", "train/logprob_diff", "train/tis_weight",
        "train/loss_tokens")
# Where the loss's "old" log-probs come from: what chooses it. "sampler" turns the
# trainer's off through --config (the switch has no --no- form); "trainer" is the
# default in bf16 (config/settings.old_logprobs), said explicitly for fp32.
SOURCES = {"sampler": "recompute_logprobs: false\n",
           "trainer": "recompute_logprobs: true\ntis_cap: 2.0\n"}


def prompts(path: Path, n: int) -> Path:
    """n short arithmetic word problems (a real model answers in a sentence or two)."""
    rows = [{"prompt": f"Tom has {a} apples and buys {b} more. How many apples does he have? Explain.",
             "answer": str(a + b)} for a, b in ((3 + i, 11 + 2 * i) for i in range(n))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Correctness plus a length term: the samples of a group get different rewards, so
# advantages are non-zero and a noisy ratio can clip (clip_frac counts a token only
# where the clipped term wins, which needs an advantage of the matching sign).
REWARD_SRC = ("def reward_fn(record):\n"
              "    return float(record.answer in record.completion) - 0.01 * len(record.completion)\n")


def run_step1(args: argparse.Namespace, source: str, work: Path) -> dict:
    """`areno train --max-steps 1` with old log-probs from `source` -> step 1's metrics."""
    out = work / f"run_{source}"
    cmd = [sys.executable, "-m", "areno.cli", "train", "--max-steps", "1", "--no-save", "--seed", "0",
           "--output-dir", str(out), "--config", str(config_file(work, source)), "--dtype", args.dtype,
           "--device", args.device, "--batch-size", str(args.batch_size), "--n-samples", str(args.n_samples),
           "--max-new-tokens", str(args.max_new_tokens), "--reward-workers", "0"]
    if args.engine:
        cmd += ["--rollout-engine", args.engine]
    if args.ckpt:
        cmd += ["--ckpt", args.ckpt, "--dataset-path", str(prompts(work / "prompts.jsonl", args.batch_size)),
                "--reward-fn-path", str(reward_file(work)), "--max-prompt-len", "256"]
    cmd += args.extra
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if res.returncode != 0:
        raise SystemExit(f"{source}: areno train failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {k: step[k] for k in KEYS if k in step}


def config_file(work: Path, source: str) -> Path:
    path = work / f"{source}.yaml"
    path.write_text(SOURCES[source])
    return path


def reward_file(work: Path) -> Path:
    path = work / "reward.py"
    path.write_text(REWARD_SRC)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="model dir (default: the demo's tiny model and task)")
    ap.add_argument("--engine", choices=("vllm", "hf"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--smoke", action="store_true", help="the demo model, 2 x 2 samples (CI)")
    ap.add_argument("--out", type=Path, default=Path("bench_results/ratio_noise.json"))
    ap.add_argument("extra", nargs="*", help="more `areno train` flags (after --)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ckpt, args.batch_size, args.n_samples, args.max_new_tokens = None, 2, 2, 3
    with tempfile.TemporaryDirectory() as tmp:
        result = {s: run_step1(args, s, Path(tmp)) for s in SOURCES}
    config = {k: getattr(args, k) for k in ("ckpt", "engine", "dtype", "device", "batch_size", "n_samples",
                                            "max_new_tokens")}
    print(f"K = 0 ratio at step 1 (before any update), {config}")
    print(f"{'old log-probs':14}" + "".join(f"{k.split('/')[1]:>15}" for k in KEYS))
    for s in SOURCES:
        print(f"{s:14}" + "".join(f"{result[s].get(k, float('nan')):>15.6g}" for k in KEYS))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "step1": result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
