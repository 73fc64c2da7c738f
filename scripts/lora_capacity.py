"""Does LoRA learn? (issue 26, 3): a supervised capacity check on the demo.

Can LoRA at rank 8 (areno's own `apply_lora`, every decoder linear, embeddings
and lm_head frozen; then with lm_head adapted too) fit the demo task's answers at all, by plain cross-entropy,
and how does it compare with full fine-tuning of the same tiny arith model?

    python scripts/lora_capacity.py                    # 300 steps, the default grid
    python scripts/lora_capacity.py --steps 600 --out bench_results/lora_capacity.json

The data are the demo's 55 prompts (`a+b=`, tokenized as the demo tokenizes
them: no chat template, special tokens added), the target the answer digit then
EOS (what the demo's reward 1.0 asks for). One full batch of 55 per AdamW step
(betas 0.9/0.999, no weight decay, no schedule), fp32 CPU, seed 0. Reported at
every --every steps: the mean cross-entropy of the two target tokens, the
greedy reward (the fraction whose argmax is the digit, then EOS: greedy
decoding's reward 1.0) and the expected reward of sampling at temperature 1,
p(digit)·(p(EOS | digit) + 0.5·(1 - p(EOS | digit))): what the demo's
`reward/mean` estimates from its samples.

The ceiling: with the final RMSNorm's weight and lm_head frozen (they are not
decoder linears), what reaches lm_head has a fixed RMS, so the logits' spread
is bounded whatever the adapters do (`head_ceiling`). On the tiny random-init
arith model (lm_head N(0, 0.02), norm weight 1) no token can get p > ~0.5:
measured, LoRA r=8 at 3e-3 and 1e-2 stops at CE 0.868 with greedy reward 1.0
and expected reward 0.307, the ceiling being CE 0.867 / 0.308; full FT reaches
CE 0.002 / 0.996 (1e-3). "LoRA+norm" (the norm's 128 weights trainable as well)
lifts the ceiling: CE 0.039 / expected reward 0.940 at 1e-2 (0.201 / 0.755 at
3e-3). 3e-2 diverges for both LoRA arms. 300 steps, seed 0, ~1 min on 2 cores.
"LoRA+head" (the demo's LoRA preset, --lora-target-modules all-linear,lm_head:
an adapter of rank 8 on the untied lm_head as well, which both engines serve)
lifts it further: CE 0.0010 / expected reward 0.998 at 3e-3 (greedy 1.0 from
step 100).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from arenobench.lib import write_json
from arenobench.lora_capacity import demo_batch, head_ceiling, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--full-lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("--lora-lrs", default="3e-3,1e-2,3e-2")
    ap.add_argument("--out", type=Path, default=Path("bench_results/lora_capacity.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areno.backend.config import LoraSpec
    from areno.backend.lora import apply_lora
    from areno.models.tiny import tiny_model_path

    torch.manual_seed(0)
    path = tiny_model_path("arith")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = demo_batch(AutoTokenizer.from_pretrained(path))
    results = []
    for lr in map(float, args.full_lrs.split(",")):
        results.append(run("full FT", copy.deepcopy(base), lr, args.steps, args.every, batch))
    spec = LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
    for lr in map(float, args.lora_lrs.split(",")):
        torch.manual_seed(0)  # the same A init for every LR
        model = apply_lora(copy.deepcopy(base), spec, str(path))
        results.append(run(f"LoRA r={args.rank}", model, lr, args.steps, args.every, batch))
        torch.manual_seed(0)  # the fix the ceiling points at: the final norm's scale trains too (128 values)
        model = apply_lora(copy.deepcopy(base), spec, str(path))
        model.get_decoder().norm.weight.requires_grad_(True)
        results.append(run("LoRA+norm", model, lr, args.steps, args.every, batch))
        torch.manual_seed(0)  # the demo's preset: an adapter on lm_head too, which both engines serve
        head = LoraSpec(rank=args.rank, alpha=2.0 * args.rank, target_modules=("all-linear", "lm_head"))
        results.append(run("LoRA+head", apply_lora(copy.deepcopy(base), head, str(path)), lr, args.steps,
                           args.every, batch))
    print(f"\n{'':<10} {'lr':>7} {'trainable':>10} {'ce':>8} {'greedy':>7} {'expected':>9}  (step {args.steps})")
    for r in results:
        last = r["curve"][-1]
        print(f"{r['name']:<10} {r['lr']:>7g} {r['trainable_params']:>10} {last['ce']:>8.4f} "
              f"{last['greedy_reward']:>7.3f} {last['expected_reward']:>9.3f}")
    ceiling = head_ceiling(base, batch[1], batch[2])
    print(f"ceiling with the final norm and lm_head frozen: ce {ceiling['ce']:.4f}, expected reward "
          f"{ceiling['expected_reward']:.3f} (largest p of a digit or EOS: {max(ceiling['max_p'].values()):.3f})")
    write_json(args.out, {"steps": args.steps, "model": str(path), "results": results, "frozen_head_ceiling": ceiling})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
