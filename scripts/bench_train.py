"""Training throughput: areno's backend vs the padded transformers loop most
users write, on the same long-tailed batch, in the same run (issue 11).

    python scripts/bench_train.py                 # CPU: 4-layer 256-wide Qwen3, 32 responses of 32-1024
    python scripts/bench_train.py --smoke         # CI: a tiny shape, seconds
    python scripts/bench_train.py --gpu           # one GPU: Qwen3-0.6B shape, 256 x (128 + 128..4096), bf16
    python scripts/bench_train.py --gpu --compile # each decoder layer torch.compile'd (both sides)

areno: `TorchBackend` (one rank process, FSDP2, the packed attention of
backend/attention.py) trains one optimizer step per call on the split pack.
padded: in this process, responses in batch order, `--pad-seqs` sequences per
micro-batch padded to the longest, full fp32 log-softmax over the vocabulary,
the GRPO clipped token-mean loss, grad clip, AdamW (bf16 autocast on GPU, fp32
master weights on both sides). Steps alternate areno / padded, so both see the
same machine load; one warm-up step each first (it holds any compile warm-up,
reported once). tokens/s counts real (unpadded) prompt + response tokens.
Peak memory: GPU allocator peak; CPU peak RSS (VmHWM) of the process that trains.
tok/cpu-s: tokens per CPU-second of the process that trains (all its threads),
a work measure that other jobs on a shared host disturb less than wall time.
MFU (GPU): (6*N*tokens + causal attention FLOPs) / dense bf16 peak (areno/perf.py).
Writes JSON to --out (default bench_results/train.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from areno.backend.config import BackendConfig
from areno.backend.controller import TorchBackend
from areno.perf import flop_shape, peak_bf16_flops, train_flops
from areno.rollout.batch import RolloutBatch, offsets_from_lengths
from areno.split import build_split_pack

MODELS = {
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=256),
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=768, vocab_size=4096),
    "gpu": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, intermediate_size=3072, vocab_size=151936),  # Qwen3-0.6B
}
# prompts x samples, prompt length, response lengths log-uniform in [lo, hi], tokens per micro, padded seqs per micro
BATCHES = {
    "smoke": dict(prompts=2, samples=4, prompt_len=8, lo=8, hi=64, micro=256, pad_seqs=2),
    "cpu": dict(prompts=4, samples=8, prompt_len=16, lo=32, hi=1024, micro=4096, pad_seqs=4),
    "gpu": dict(prompts=32, samples=8, prompt_len=128, lo=128, hi=4096, micro=16384, pad_seqs=2),
}


def build_model_dir(shape: dict, out: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)


def make_batch(b: dict, vocab: int, seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
    """Long-tailed batch: response lengths log-uniform in [lo, hi]; random advantages."""
    rng = np.random.default_rng(seed)
    P, n = b["prompts"], b["samples"]
    r_len = np.exp(rng.uniform(math.log(b["lo"]), math.log(b["hi"] + 1), P * n)).astype(np.int64)
    p_len = np.full(P, b["prompt_len"], dtype=np.int64)
    T = int(r_len.sum())
    batch = RolloutBatch(
        prompt_ids=rng.integers(2, vocab, int(p_len.sum())).astype(np.int32),
        prompt_offsets=offsets_from_lengths(p_len),
        response_ids=rng.integers(2, vocab, T).astype(np.int32),
        response_offsets=offsets_from_lengths(r_len),
        response_logprobs=(-rng.random(T) * 3).astype(np.float32),
        group_index=np.repeat(np.arange(P), n).astype(np.int64),
        finish_reason=np.zeros(P * n, dtype=np.uint8),
    )
    return batch, rng.standard_normal(P * n).astype(np.float32)


# -- the padded loop, as users write it -------------------------------------
def padded_micro_batches(batch: RolloutBatch, adv: np.ndarray, per_micro: int) -> list[dict]:
    """Responses in batch order, `per_micro` per micro-batch, right-padded."""
    out = []
    N = batch.num_responses
    for a in range(0, N, per_micro):
        seqs = []
        for i in range(a, min(a + per_micro, N)):
            g = int(batch.group_index[i])
            p = batch.prompt_ids[batch.prompt_offsets[g]:batch.prompt_offsets[g + 1]]
            r0, r1 = batch.response_offsets[i], batch.response_offsets[i + 1]
            seqs.append((p, batch.response_ids[r0:r1], batch.response_logprobs[r0:r1], adv[i]))
        T = max(len(p) + len(r) for p, r, _, _ in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        attn = torch.zeros(len(seqs), T, dtype=torch.long)
        resp = torch.zeros(len(seqs), T, dtype=torch.bool)  # position holds a response token
        old = torch.zeros(len(seqs), T)
        advs = torch.zeros(len(seqs), 1)
        for j, (p, r, lp, ad) in enumerate(seqs):
            n = len(p) + len(r)
            ids[j, :n] = torch.from_numpy(np.concatenate([p, r]).astype(np.int64))
            attn[j, :n] = 1
            resp[j, len(p):n] = True
            old[j, len(p):n] = torch.from_numpy(lp)
            advs[j] = float(ad)
        out.append(dict(ids=ids, attn=attn, resp=resp, old=old, adv=advs))
    return out


def padded_step(model, opt, micros: list[dict], device: torch.device, dtype: torch.dtype,
                clip: float = 0.2) -> None:
    """One optimizer step: full log-softmax, GRPO clipped loss, token-mean over the step."""
    total = sum(int(m["resp"][:, 1:].sum()) for m in micros)
    for m in micros:
        ids, attn = m["ids"].to(device), m["attn"].to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask, old, adv = m["resp"][:, 1:].to(device), m["old"][:, 1:].to(device), m["adv"].to(device)
        ratio = torch.exp(logp - old)
        per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        ((per_tok * mask).sum() / total).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":  # hand the cached blocks back: areno's rank shares the GPU
        torch.cuda.empty_cache()


def load_padded(model_dir: Path, device: torch.device, compile_layers: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model.to(device).train()
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-6)


# -- measuring -----------------------------------------------------------------
def vm_hwm_gb(pid: int | str = "self") -> float:
    """Peak resident set of a process (GB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all threads): `pid`, or this one."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn, device: torch.device, pid: int | None = None) -> tuple[float, float]:
    """(wall s, CPU s of the process that does the work) of fn()."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), cpu_seconds(pid)
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, cpu_seconds(pid) - c0


def run(args: argparse.Namespace) -> dict:
    kind = "smoke" if args.smoke else ("gpu" if args.gpu else "cpu")
    shape, b = MODELS[kind], dict(BATCHES[kind])
    if args.micro_tokens:
        b["micro"] = args.micro_tokens
    if args.pad_seqs:
        b["pad_seqs"] = args.pad_seqs
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.gpu else torch.float32
    batch, adv = make_batch(b, shape["vocab_size"], args.seed)
    split = build_split_pack(batch, adv, world_size=1, max_tokens=b["micro"], num_minibatches=1)
    lengths = split.pack.seq_lengths
    tokens = float(lengths.sum())
    res: dict = {"meta": {"kind": kind, "shape": shape, "batch": b, "tokens_per_step": tokens,
                          "seqs": int(lengths.size), "micro_batches": int(split.num_micro),
                          "compile": args.compile, "attn": args.attn, "repeats": args.repeats,
                          "threads": torch.get_num_threads()}}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model_dir(shape, model_dir)
        cfg = BackendConfig(model_path=str(model_dir), world_size=1, device=device.type,
                            dtype="bfloat16" if args.gpu else "float32", lr=1e-6, attn_implementation=args.attn,
                            cpu_threads=torch.get_num_threads(),
                            **({"compile_layers": True} if args.compile else {}))
        model, opt = load_padded(model_dir, device, args.compile)
        shape_f = flop_shape(model)
        micros = padded_micro_batches(batch, adv, b["pad_seqs"])
        with TorchBackend(cfg) as backend:
            rank_pid = backend.rank_pids[0]
            steps = {"areno": (lambda: backend.train(split), rank_pid),
                     "padded": (lambda: padded_step(model, opt, micros, device, dtype), None)}
            warm = {name: timed(fn, device, pid)[0] for name, (fn, pid) in steps.items()}
            times: dict[str, list[float]] = {"areno": [], "padded": []}
            cpu: dict[str, list[float]] = {"areno": [], "padded": []}
            for _ in range(args.repeats):  # alternate, so both see the same load
                for name, (fn, pid) in steps.items():
                    w, c = timed(fn, device, pid)
                    times[name].append(w)
                    cpu[name].append(c)
            peak = {"areno": backend.last_timings.get("peak_gpu_mem_gb") if args.gpu else vm_hwm_gb(rank_pid),
                    "padded": torch.cuda.max_memory_allocated() / 2**30 if args.gpu else vm_hwm_gb()}
            res["areno_perf"] = dict(getattr(backend, "last_perf", {}))
    flops = train_flops(shape_f, lengths)
    peak_flops = peak_bf16_flops(torch.cuda.get_device_name() if args.gpu else None)
    for name, ts in times.items():
        med = statistics.median(ts)
        cmed = statistics.median(cpu[name])
        res[name] = {"times_s": ts, "median_s": med, "tokens_per_s": tokens / med, "warmup_s": warm[name],
                     "cpu_s": cpu[name], "tokens_per_cpu_s": tokens / cmed if cmed > 0 else None,
                     "peak_mem_gb": peak[name],
                     "mfu": flops / med / peak_flops if peak_flops else None}
    res["ratio"] = res["areno"]["tokens_per_s"] / res["padded"]["tokens_per_s"]
    pair = [p / a for a, p in zip(times["areno"], times["padded"])]
    res["ratio_pairs_median"] = statistics.median(pair)
    res["ratio_cpu"] = (res["areno"]["tokens_per_cpu_s"] / res["padded"]["tokens_per_cpu_s"]
                        if res["padded"]["tokens_per_cpu_s"] and res["areno"]["tokens_per_cpu_s"] else None)
    res["padded_fill"] = tokens / sum(float(m["ids"].numel()) for m in micros)  # real / padded positions
    return res


def sweep_micro(args: argparse.Namespace, budgets: list[int]) -> dict:
    """areno alone, one backend, budgets in ascending order (peak memory is a
    running maximum, so it is the peak of the largest budget so far)."""
    kind = "smoke" if args.smoke else ("gpu" if args.gpu else "cpu")
    shape, b = MODELS[kind], BATCHES[kind]
    device = torch.device("cuda" if args.gpu else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, adv = make_batch(b, shape["vocab_size"], args.seed)
    out: dict = {"meta": {"kind": kind, "sweep": budgets, "repeats": args.repeats}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model_dir = Path(tmp) / "model"
        build_model_dir(shape, model_dir)
        cfg = BackendConfig(model_path=str(model_dir), world_size=1, device=device.type,
                            dtype="bfloat16" if args.gpu else "float32", lr=1e-6, attn_implementation=args.attn,
                            cpu_threads=torch.get_num_threads(), **({"compile_layers": True} if args.compile else {}))
        with TorchBackend(cfg) as backend:
            pid = backend.rank_pids[0]
            for budget in sorted(budgets):
                split = build_split_pack(batch, adv, world_size=1, max_tokens=budget, num_minibatches=1)
                tokens = float(split.pack.num_tokens)
                timed(lambda: backend.train(split), device, pid)
                runs = [timed(lambda: backend.train(split), device, pid) for _ in range(args.repeats)]
                w, c = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
                peak = backend.last_timings.get("peak_gpu_mem_gb") if args.gpu else vm_hwm_gb(pid)
                out["rows"].append({"micro_tokens": budget, "micro_batches": int(split.num_micro),
                                    "tokens_per_s": tokens / w, "tokens_per_cpu_s": tokens / c, "peak_mem_gb": peak})
    lines = [f"bench_train {kind} micro-batch sweep (areno only, median of {args.repeats})",
             f"{'budget':>7} {'micros':>6} {'tokens/s':>9} {'tok/cpu-s':>9} {'peak GB':>8}"]
    lines += [f"{r['micro_tokens']:7d} {r['micro_batches']:6d} {r['tokens_per_s']:9,.0f} "
              f"{r['tokens_per_cpu_s']:9,.0f} {r['peak_mem_gb']:8.2f}" for r in out["rows"]]
    out["report"] = "\n".join(lines)
    return out


def report(res: dict) -> str:
    m = res["meta"]
    lines = [f"bench_train {m['kind']}: {m['seqs']} seqs, {m['tokens_per_step']:,.0f} tokens/step, "
             f"areno {m['micro_batches']} micro-batches of <= {m['batch']['micro']} tokens (attn {m['attn']}), "
             f"padded {m['batch']['pad_seqs']} seqs/micro ({res['padded_fill']:.0%} real), compile={m['compile']}, "
             f"median of {m['repeats']}",
             f"{'trainer':8} {'tokens/s':>10} {'step s':>8} {'tok/cpu-s':>10} {'warm-up s':>10} {'peak GB':>8} "
             f"{'MFU':>6}"]
    for name in ("areno", "padded"):
        r = res[name]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        tpc = f"{r['tokens_per_cpu_s']:,.0f}" if r["tokens_per_cpu_s"] else "-"
        lines.append(f"{name:8} {r['tokens_per_s']:10,.0f} {r['median_s']:8.3f} {tpc:>10} {r['warmup_s']:10.2f} "
                     f"{r['peak_mem_gb']:8.2f} {mfu:>6}")
    cpu = f"; per CPU-second {res['ratio_cpu']:.2f}x" if res["ratio_cpu"] else ""
    lines.append(f"ratio areno/padded: {res['ratio']:.2f}x tokens/s (median of per-pair ratios "
                 f"{res['ratio_pairs_median']:.2f}x{cpu})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="one CUDA GPU, Qwen3-0.6B shape, bf16")
    mode.add_argument("--smoke", action="store_true", help="tiny CPU shape for CI")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (both trainers)")
    ap.add_argument("--attn", default="auto", help="areno's attn_implementation (auto, varlen, flex, sdpa, ...)")
    ap.add_argument("--micro-tokens", type=int, default=None, help="areno's token budget per micro-batch")
    ap.add_argument("--pad-seqs", type=int, default=None, help="padded loop: sequences per micro-batch")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per trainer (default 5; smoke 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of both trainers (default: torch's, one per core)")
    ap.add_argument("--sweep-micro", default=None,
                    help="comma-separated micro-batch budgets: time areno alone at each (choosing the default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_results/train.json"))
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 5
    if args.gpu and not torch.cuda.is_available():
        print("bench_train: --gpu needs a CUDA device", file=sys.stderr)
        return 2
    if args.sweep_micro:
        res = sweep_micro(args, [int(x) for x in args.sweep_micro.split(",")])
    else:
        res = run(args)
        res["report"] = report(res)
    print(res["report"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
