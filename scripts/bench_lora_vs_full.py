"""LoRA against full fine-tuning on SmolLM2-135M-Instruct (issue 26, 3): the demo's
one-digit addition through the chat template, same steps, seed and batch.

    python scripts/bench_lora_vs_full.py                        # 20 steps, 4 prompts x 4 samples, 4 new tokens
    python scripts/bench_lora_vs_full.py --steps 40 --cache /tmp/areno_cache

Runs `areno train` twice (full FT at --lr, LoRA r=--rank on every decoder linear at
10x --lr, areno's LoRA rule) and prints the mean reward per block of steps side by
side, the first / last --window steps' means and the best window. The model is
built once into --cache (scripts/arenobench/smol.py). Library: scripts/arenobench/lora_vs_full.py.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from arenobench.lib import write_json
from arenobench.lora_vs_full import Arm, add_task_args, curve_summary, run_arm, side_by_side, train_args, write_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-5, help="full FT's; LoRA takes 10x")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--engine", default="hf", choices=["vllm", "hf"])
    ap.add_argument("--threads", type=int, default=2)
    add_task_args(ap)
    ap.add_argument("--out", type=Path, default=Path("bench_results/lora_vs_full.json"))
    args = ap.parse_args()

    from areno.config.lora import LORA_LR_FACTOR
    from arenobench.smol import smol_model_path

    model = args.model or smol_model_path(args.cache)
    arms = [Arm("full FT", 0, args.lr), Arm(f"LoRA r={args.rank}", args.rank, args.lr * LORA_LR_FACTOR)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_task(Path(tmp) / "arith.jsonl")
        for i, arm in enumerate(arms):
            out = Path(tmp) / f"run{i}"
            cmd = train_args(model, data, out, arm, args.steps, args.seed, args.batch_size, args.n_samples,
                             args.max_new_tokens, args.engine, args.threads)
            print(f"{arm.name}: lr {arm.lr:g} ...", flush=True)
            results[arm.name] = {"lr": arm.lr, **run_arm(cmd, out)}
            results[arm.name]["summary"] = curve_summary(results[arm.name]["rewards"], args.window)
    print("\nmean reward/mean per block of steps")
    print("\n".join(side_by_side({n: r["rewards"] for n, r in results.items()}, args.window // 2 or 1)))
    for name, r in results.items():
        s = r["summary"]
        print(f"{name:<10} lr {r['lr']:<7g} first {args.window} {s['first']:.3f}  last {args.window} "
              f"{s['last']:.3f}  best {args.window}-step mean {s['best']:.3f} (to step {s['best_end_step']})  "
              f"{r['seconds']:.0f} s")
    write_json(args.out, {"model": str(model), "steps": args.steps, "seed": args.seed, "batch_size": args.batch_size,
                          "n_samples": args.n_samples, "max_new_tokens": args.max_new_tokens, "arms": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
