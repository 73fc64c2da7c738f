"""Does LoRA learn? (issue 26, 3): a supervised capacity check on the demo.

Can LoRA at rank 8 (areno's own `apply_lora`, every decoder linear, embeddings
and lm_head frozen) fit the demo task's answers at all, by plain cross-entropy,
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
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F


from areno.bench.lib import write_json


def demo_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> ([55, L] prompt ids, [55] answer digit ids, EOS id)."""
    from areno.data.tasks.arith import rows

    data = rows()
    ids = tokenizer([r["prompt"] for r in data], add_special_tokens=True)["input_ids"]
    if len({len(x) for x in ids}) != 1:
        raise SystemExit("the demo prompts do not tokenize to one length")
    digits = [tokenizer(r["answer"], add_special_tokens=False)["input_ids"] for r in data]
    assert all(len(d) == 1 for d in digits)
    return torch.tensor(ids), torch.tensor([d[0] for d in digits]), int(tokenizer.eos_token_id)


def scores(model, prompts: torch.Tensor, digits: torch.Tensor, eos: int) -> tuple[torch.Tensor, dict]:
    """Teacher-forced over prompt + digit: (mean CE of digit and EOS, metrics)."""
    x = torch.cat([prompts, digits[:, None]], dim=1)
    logits = model(input_ids=x).logits[:, -2:].float()  # [N, 2, V]: the digit's and EOS's positions
    target = torch.stack([digits, torch.full_like(digits, eos)], dim=1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    with torch.no_grad():
        p = logits.softmax(-1).gather(-1, target[..., None])[..., 0]  # [N, 2]
        greedy = (logits.argmax(-1) == target).all(-1).float().mean()
        expected = (p[:, 0] * (p[:, 1] + 0.5 * (1 - p[:, 1]))).mean()
    return loss, {"ce": float(loss), "greedy_reward": float(greedy), "expected_reward": float(expected)}


def head_ceiling(model, digits: torch.Tensor, eos: int, steps: int = 2000) -> dict:
    """The best any adapter of the decoder linears can do: the final RMSNorm (weight
    frozen) hands lm_head (frozen) a vector of RMS |weight| whatever the layers
    compute, so per target token t the least CE is min over such vectors h of
    -log softmax(W h)[t], found here by gradient descent on h's direction (Adam,
    2,000 steps from 64 random starts, the best kept). -> the mean CE and the
    expected reward this ceiling allows on the demo's targets."""
    norm, head = model.get_decoder().norm, model.get_output_embeddings()
    w = head.weight.detach().float()  # [V, d]
    g = norm.weight.detach().float()  # [d]
    best = {}
    for t in sorted({*digits.tolist(), eos}):
        u = torch.randn(64, w.shape[1], requires_grad=True)
        opt = torch.optim.Adam([u], lr=0.05)
        target = torch.full((64,), t)
        for _ in range(steps):
            h = g * (u / u.pow(2).mean(-1, keepdim=True).sqrt())  # RMSNorm's output: RMS 1, times its weight
            loss = F.cross_entropy(h @ w.T, target, reduction="none")
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
        best[t] = float(loss.min())
    ce_d = torch.tensor([best[int(d)] for d in digits])
    ce_e = torch.tensor(best[eos])
    p_d, p_e = (-ce_d).exp(), (-ce_e).exp()
    return {"ce": float((ce_d.mean() + ce_e) / 2), "expected_reward": float((p_d * (p_e + 0.5 * (1 - p_e))).mean()),
            "max_p": {str(k): float(torch.tensor(-v).exp()) for k, v in best.items()}}


def run(name: str, model, lr: float, steps: int, every: int, batch) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    curve, t0 = [], time.perf_counter()
    model.eval()  # no dropout anywhere (the tiny model has none; LoRA's is 0 here)
    for step in range(steps + 1):
        loss, m = scores(model, *batch)
        if step % every == 0 or step == steps:
            curve.append({"step": step, **m})
            print(f"  {name:<10} lr {lr:<7g} step {step:>4}: ce {m['ce']:.4f}  greedy reward "
                  f"{m['greedy_reward']:.3f}  expected reward {m['expected_reward']:.3f}", flush=True)
        if step == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    trainable = sum(p.numel() for p in params)
    return {"name": name, "lr": lr, "trainable_params": trainable, "curve": curve,
            "seconds": time.perf_counter() - t0}


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
