"""LoRA vs full fine-tuning on the same model and batch (issue 19): optimizer-state
bytes, checkpoint bytes and train-step time.

    python scripts/bench_lora.py                  # the tiny chat model (built locally)
    python scripts/bench_lora.py --smol           # also SmolLM2-135M (scripts/arenobench/smol.py, cached)
    python scripts/bench_lora.py --smoke          # CI: tiny model, 2 steps

For each of full FT and LoRA r=8 (all-linear): one TorchBackend (1 rank, CPU
fp32 unless --gpu), one warm-up train call, then --steps timed calls on one
fixed pack (one optimizer step each); optimizer bytes = AdamW's state tensors
(exp_avg + exp_avg_sq + step) summed on the rank, read from the saved DCP
directory's size; checkpoint bytes = what save_pretrained + save_state write
(the model or the adapter, tokenizer, optimizer, schedule, RNG). Writes JSON to
--out (default bench_results/lora.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from arenobench.lib import write_json


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_split(vocab: int, seqs: int, length: int, seed: int = 0):
    from areno.rollout.batch import RolloutBatch
    from areno.split import build_split_pack

    rng = np.random.default_rng(seed)
    lens = np.full(seqs, length, dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)])
    p_offs = np.arange(seqs + 1, dtype=np.int64) * 8
    T = int(lens.sum())
    batch = RolloutBatch(
        prompt_ids=rng.integers(2, vocab, seqs * 8).astype(np.int32), prompt_offsets=p_offs,
        response_ids=rng.integers(2, vocab, T).astype(np.int32), response_offsets=offs,
        response_logprobs=(-rng.random(T) * 3).astype(np.float32),
        group_index=np.arange(seqs, dtype=np.int64), finish_reason=np.zeros(seqs, dtype=np.uint8))
    adv = rng.standard_normal(seqs).astype(np.float32)
    return build_split_pack(batch, adv, world_size=1, max_tokens=4096)


def measure(model: Path, lora, steps: int, split, device: str, dtype: str) -> dict:
    from areno.backend import BackendConfig, TorchBackend

    cfg = BackendConfig(model_path=str(model), world_size=1, lr=1e-5, device=device, dtype=dtype, lora=lora)
    with TorchBackend(cfg) as be, tempfile.TemporaryDirectory() as tmp:
        be.train(split)  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            be.train(split)
            times.append(time.perf_counter() - t0)
        be.save_pretrained(Path(tmp) / "ckpt")
        be.save_state(Path(tmp) / "ckpt" / "backend")
        return {"step_s": statistics.median(times), "optimizer_bytes": du(Path(tmp) / "ckpt" / "backend" / "optim"),
                "checkpoint_bytes": du(Path(tmp) / "ckpt")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smol", action="store_true", help="also SmolLM2-135M (cached in $ARENO_CACHE)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 steps (CI)")
    ap.add_argument("--gpu", action="store_true", help="cuda, bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default="bench_results/lora.json")
    args = ap.parse_args(argv)
    from areno.backend.config import LoraSpec
    from areno.models.tiny import tiny_model_path

    cache = Path(os.environ.get("ARENO_CACHE", "/work/areno_cache"))
    models = {"tiny-chat": tiny_model_path("chat", cache_dir=cache)}
    if args.smol and not args.smoke:
        from arenobench.smol import smol_model_path

        models["smollm2-135m"] = smol_model_path(cache)
    steps = 2 if args.smoke else args.steps
    device, dtype = ("cuda", "bfloat16") if args.gpu else ("cpu", "float32")
    lora = LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
    from transformers import AutoConfig

    res: dict = {"rank": args.rank, "device": device, "dtype": dtype, "models": {}}
    for name, path in models.items():
        vocab = AutoConfig.from_pretrained(path).vocab_size
        split = make_split(vocab, seqs=8, length=32 if args.smoke else 128)
        row = {"full": measure(path, None, steps, split, device, dtype),
               "lora": measure(path, lora, steps, split, device, dtype)}
        res["models"][name] = row
        f, lo = row["full"], row["lora"]
        print(f"{name}: optimizer {f['optimizer_bytes'] / 2**20:.2f} MiB -> {lo['optimizer_bytes'] / 2**20:.3f} MiB "
              f"({f['optimizer_bytes'] / lo['optimizer_bytes']:.0f}x); checkpoint "
              f"{f['checkpoint_bytes'] / 2**20:.2f} MiB -> {lo['checkpoint_bytes'] / 2**20:.3f} MiB "
              f"({f['checkpoint_bytes'] / lo['checkpoint_bytes']:.0f}x); step "
              f"{f['step_s'] * 1e3:.0f} ms -> {lo['step_s'] * 1e3:.0f} ms", flush=True)
    write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
