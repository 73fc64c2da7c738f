"""lm_head backward time: in bf16 (ChunkedLogProbs after a bf16 autocast
forward, as `single`/DDP train now) vs in fp32 (its backward before issue 17 2c,
when `.backward()` outside autocast followed the fp32 master weights), in the
same run, interleaved.

    python scripts/bench_lm_head.py                  # CPU: 1K tokens, hidden 256, vocab 4K
    python scripts/bench_lm_head.py --smoke          # CI: a tiny shape, seconds
    python scripts/bench_lm_head.py --device cuda    # Qwen3-0.6B's lm_head, 16K tokens
    python scripts/bench_lm_head.py --shape smollm2   # SmolLM2-135M's lm_head, 256 tokens (CPU)

Each path runs its forward once, then times `torch.autograd.grad` of
(logp * a + entropy * b) over its graph (retain_graph), with a device sync per
call on CUDA (TF32 left at torch's default, off for matmuls). `ratio` is the
fp32 median over the bf16 median. The two gradients are compared as well (the
bf16 one against the fp32 one's direction: relative L2 error). Writes JSON to
--out (default bench_results/lm_head.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from areno.backend.model import chunked_logprobs
from arenobench.lib import table, time_interleaved, write_json

SHAPES = {  # tokens N, hidden H, vocab V, positions per lm_head chunk
    "smoke": dict(tokens=256, hidden=64, vocab=1024, chunk=128),
    "cpu": dict(tokens=1024, hidden=256, vocab=4096, chunk=512),  # CPUs without bf16 GEMMs emulate them: slow
    "cuda": dict(tokens=16384, hidden=1024, vocab=151936, chunk=4096),  # Qwen3-0.6B, logprob_chunk_size 4096
    "smollm2": dict(tokens=256, hidden=576, vocab=49152, chunk=4096),  # the suite's real model, one CPU step
}


def make_case(shape: dict, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 master-weight lm_head and hidden states; logits of real-model scale (|z| ~ 30)."""
    g = torch.Generator().manual_seed(seed)
    n, h, v = shape["tokens"], shape["hidden"], shape["vocab"]
    case = {
        "hidden": torch.randn(n, h, generator=g),
        "weight": torch.randn(v, h, generator=g) * (8.0 / h ** 0.5),
        "targets": torch.randint(0, v, (n,), generator=g),
        "a": torch.randn(n, generator=g),
        "b": torch.randn(n, generator=g),
    }
    return {k: t.to(device) for k, t in case.items()}


def backward_fn(case: dict, chunk: int, autocast_dtype: torch.dtype | None):
    """(call, grads): `call()` runs one lm_head backward over a forward built
    under autocast(autocast_dtype), or without autocast when None."""
    dev = case["hidden"].device
    h = case["hidden"].clone().requires_grad_()
    w = case["weight"].clone().requires_grad_()
    ctx = torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype else torch.autocast(dev.type, enabled=False)
    with ctx:
        lp, ent = chunked_logprobs(h, w, case["targets"], chunk)
    loss = (lp * case["a"] + ent * case["b"]).sum()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def call():
        grads = torch.autograd.grad(loss, [h, w], retain_graph=True)
        sync()
        return grads

    return call


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(shape_name: str, device: torch.device, repeats: int, min_run_time: float) -> dict:
    shape = SHAPES[shape_name]
    case = make_case(shape, device)
    fns = {"fp32 (before)": backward_fn(case, shape["chunk"], None),
           "bf16 (now)": backward_fn(case, shape["chunk"], torch.bfloat16)}
    g32, g16 = (fn() for fn in fns.values())
    t = time_interleaved(fns, repeats, min_run_time)
    before, now = t["fp32 (before)"]["median_s"], t["bf16 (now)"]["median_s"]
    return {
        "shape": shape_name, "device": str(device), **shape, "timings": t,
        "ratio": before / now if now > 0 else float("inf"),
        "grad_rel_err": {"hidden": rel_err(g16[0], g32[0]), "weight": rel_err(g16[1], g32[1])},
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape (CI)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: smoke, else the device's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timed run (several calls if short)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU; default: torch's)")
    ap.add_argument("--out", type=Path, default=Path("bench_results/lm_head.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.shape or ("smoke" if args.smoke else args.device)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    res = run(name, device, args.repeats, args.min_run_time)
    rows = [(k, [v["median_s"] * 1e3, v["min_s"] * 1e3]) for k, v in res["timings"].items()]
    print(f"lm_head backward, {name}: N={res['tokens']} H={res['hidden']} V={res['vocab']} chunk={res['chunk']}"
          f" on {res['device_name'] or res['device']} ({res['threads']} threads)")
    print("\n".join(table("path", 14, [("median ms", "10.2f"), ("min ms", "10.2f")], rows)))
    print(f"fp32 / bf16: x{res['ratio']:.2f}; bf16 vs fp32 gradient: rel err hidden "
          f"{res['grad_rel_err']['hidden']:.2e}, weight {res['grad_rel_err']['weight']:.2e}")
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
