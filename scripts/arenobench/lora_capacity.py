"""Does LoRA learn? (issue 26, 3): a supervised capacity check on the demo, the
library of scripts/lora_capacity.py (its docstring has the method and figures).

Can LoRA at a rank fit the demo's answers at all, by plain cross-entropy over one
full batch of the 55 prompts (no RL noise), and where is the ceiling of frozen
modules? `head_ceiling` bounds what adapters of the decoder linears can reach
when the final norm and lm_head are frozen.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


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
