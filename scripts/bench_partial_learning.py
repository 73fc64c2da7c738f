"""Does the real model learn as fast per step with --partial-rollouts at K as
synchronously (issue 39, "the real model's addition task learns as fast per
step as K = 0 within noise")? SmolLM2-135M-Instruct on the demo's one-digit
addition through the chat template (arenobench/lora_vs_full.py's task), one
engine process beside one rank, same seed, steps and batch:

    python scripts/bench_partial_learning.py                      # 60 steps, K = 2, vLLM
    python scripts/bench_partial_learning.py --steps 60 --seeds 0 1

Arms, one `areno train` each, one after the other: K = 0 (synchronous) and
K = --k with --partial-rollouts. Prints the mean reward per block of steps side
by side, each arm's first / last --window steps' mean, and the partial arm's
per-token lag histogram summed over the run (rollout/token_lag_<l>). With
several seeds, the means over seeds too. Library: arenobench/lora_vs_full.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from arenobench.lib import write_json
from arenobench.lora_vs_full import Arm, add_task_args, curve_summary, run_arm, side_by_side, train_args, write_task


def lag_histogram(run_dir: Path, k: int) -> list[int]:
    """metrics.jsonl -> tokens trained at lag 0..k, summed over the run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [int(sum(r.get(f"rollout/token_lag_{lag}", 0) for r in rows)) for lag in range(k + 1)]


def arms(k: int, lr: float, lora_rank: int) -> list[Arm]:
    """Synchronous and partial at K, both in split placement (one engine process)."""
    split = ("--rollout-world-size", "1")
    return [Arm("K=0", lora_rank, lr, split + ("--off-policy-steps", "0")),
            Arm(f"K={k} partial", lora_rank, lr, split + ("--off-policy-steps", str(k), "--partial-rollouts"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4, help="LoRA's (--lora-rank > 0), else full FT's")
    ap.add_argument("--lora-rank", type=int, default=8, help="0: full fine-tuning")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    ap.add_argument("--threads", type=int, default=1, help="per process: the rank and the engine share the cores")
    add_task_args(ap)
    ap.add_argument("--out", type=Path, default=Path("bench_results/partial_learning.json"))
    args = ap.parse_args()

    from arenobench.smol import smol_model_path

    model = args.model or smol_model_path(args.cache)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_task(Path(tmp) / "arith.jsonl")
        for seed in args.seeds:
            for i, arm in enumerate(arms(args.k, args.lr, args.lora_rank)):
                out = Path(tmp) / f"s{seed}-{i}"
                cmd = train_args(model, data, out, arm, args.steps, seed, args.batch_size, args.n_samples,
                                 args.max_new_tokens, args.engine, args.threads)
                print(f"{arm.name}, seed {seed} ...", flush=True)
                r = run_arm(cmd, out)
                r["summary"] = curve_summary(r["rewards"], args.window)
                r["token_lag"] = lag_histogram(out, args.k)
                results[f"{arm.name} s{seed}"] = r
    report(results, args)
    write_json(args.out, {"model": str(model), "steps": args.steps, "seeds": args.seeds, "k": args.k,
                          "batch_size": args.batch_size, "n_samples": args.n_samples, "lr": args.lr,
                          "lora_rank": args.lora_rank, "engine": args.engine, "arms": results})
    print(f"wrote {args.out}")


def report(results: dict[str, dict], args) -> None:
    """The side-by-side table, each run's summary, and the means over seeds."""
    print("\nmean reward/mean per block of steps")
    print("\n".join(side_by_side({n: r["rewards"] for n, r in results.items()}, args.window // 2 or 1)))
    for name, r in results.items():
        s = r["summary"]
        print(f"{name:<16} first {args.window} {s['first']:.3f}  last {args.window} {s['last']:.3f}  "
              f"best {s['best']:.3f} (to step {s['best_end_step']})  token lag 0..K {r['token_lag']}  "
              f"{r['seconds']:.0f} s")
    for arm in arms(args.k, args.lr, args.lora_rank):
        runs = [r for n, r in results.items() if n.startswith(arm.name + " s")]
        first = np.mean([r["summary"]["first"] for r in runs])
        last = np.mean([r["summary"]["last"] for r in runs])
        print(f"{arm.name:<16} over {len(runs)} seed(s): first {first:.3f}  last {last:.3f}")


if __name__ == "__main__":
    main()
