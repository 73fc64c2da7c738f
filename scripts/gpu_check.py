"""GPU check of the torch backend: FSDP2 over NCCL, bf16, on a Qwen3-0.6B-shaped
model built locally (random weights, no download), with the transformers
rollout engine (no vLLM needed). A few GRPO steps; reports the step-time
breakdown (rollout, host, hand-off, train, weight sync), tokens/s and peak GPU
memory into a results file.

    python scripts/gpu_check.py --out gpu_check.txt          # needs one NVIDIA GPU
    python scripts/gpu_check.py --cpu-smoke --out smoke.txt   # same logic, tiny shape, CPU

It drives TorchBackend and HFEngine directly (not the `areno train` CLI). The
reward is synthetic (fraction of even token ids), so the run measures the
machinery, not learning. Exit code 0 when every check line says PASS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512,
            rope_theta=10000.0)


class Report:
    def __init__(self, path: Path) -> None:
        self.path, self.lines, self.ok = path, [], True

    def add(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.path.write_text("\n".join(self.lines) + "\n")

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.ok &= bool(ok)
        self.add(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")


def build_model_dir(shape: dict, device: str, out: Path) -> None:
    """Random-init Qwen3 of `shape` (bf16 on disk) + the tiny chat tokenizer files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from areno.tiny import tiny_model_path

    tok_dir = tiny_model_path("chat", cache_dir=out.parent / "tiny-cache")
    cfg = Qwen3Config(**shape, rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=0, eos_token_id=2,
                      pad_token_id=0, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):  # init on the GPU: seconds instead of a minute on CPU
        model = Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    del model
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / f).is_file():
            shutil.copy2(tok_dir / f, out / f)
    if device == "cuda":
        torch.cuda.empty_cache()


def packed_attention_check(device: str, impl: str = "sdpa") -> float:
    """max |packed - padded| log-prob on a tiny model on `device` with areno's packed
    kernel `impl` (backend/attention.py); fp32, bf16 for the flash kernels."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from areno.backend.attention import hf_name, register
    from areno.backend.model import PolicyModule
    from areno.pack import build_train_pack
    from areno.rollout.batch import RolloutBatch, offsets_from_lengths

    torch.manual_seed(0)
    register()
    cfg = Qwen3Config(**(TINY | {"vocab_size": 300}), attn_implementation=hf_name(impl))
    dtype = torch.bfloat16 if impl in ("varlen", "flash_attention_2") else torch.float32  # flash: no fp32
    hf = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    rng = np.random.default_rng(0)
    p_len, r_len = np.array([5, 9, 3]), np.array([7, 4, 11, 6, 8, 2])
    b = RolloutBatch(rng.integers(0, 300, p_len.sum()).astype(np.int32), offsets_from_lengths(p_len),
                     rng.integers(0, 300, r_len.sum()).astype(np.int32), offsets_from_lengths(r_len),
                     np.zeros(r_len.sum(), np.float32), np.array([0, 0, 1, 1, 2, 2]), np.zeros(6, np.uint8))
    pack = build_train_pack(b, np.zeros(6, np.float32))
    pol = PolicyModule(hf, 5)
    d = torch.device(device)
    with torch.no_grad():
        lp, _ = pol(pack.input_ids.long()[None].to(d), pack.position_ids.long()[None].to(d),
                    pack.targets.long()[None].to(d))
        pad = pack.to_padded()
        lpp, _ = pol(pad.input_ids.long().to(d), pad.position_ids.long().to(d), pad.targets.long().to(d),
                     attention_mask=pad.attention_mask.long().to(d))
    return float((lp[0] - lpp[pad.attention_mask.to(d)]).abs().max().cpu())


def make_prompts(n: int, length: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n prompts of equal length (HFEngine samples equal lengths together)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, min(vocab, 400), n * length).astype(np.int32)
    return ids, np.arange(0, n * length + 1, length, dtype=np.int64)


def rewards_of(batch) -> np.ndarray:
    """Fraction of even token ids per response (vectorized; synthetic)."""
    even = (batch.response_ids % 2 == 0).astype(np.float64)
    lens = np.diff(batch.response_offsets)
    sums = np.add.reduceat(even, batch.response_offsets[:-1]) if even.size else np.zeros(lens.size)
    return (np.where(lens > 0, sums, 0.0) / np.maximum(lens, 1)).astype(np.float32)


def run(args: argparse.Namespace, rep: Report, work: Path) -> None:
    from areno.backend import TorchBackend
    from areno.rollout.hf import HFEngine

    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if not _header(rep, smoke):
        return
    shape = TINY if smoke else QWEN3_06B
    rep.add(f"model shape: {json.dumps(shape)}")
    _attention_checks(rep, device)
    t = time.perf_counter()
    model_dir = work / "model"
    build_model_dir(shape, device, model_dir)
    rep.add(f"built random model in {time.perf_counter() - t:.1f}s -> {model_dir}")
    cfg = _backend_config(args, model_dir, device)
    engine_dtype = "float32" if smoke else "bfloat16"
    t = time.perf_counter()
    backend = TorchBackend(cfg)
    rep.add(f"backend up in {time.perf_counter() - t:.1f}s (strategy {backend.strategy}, "
            f"{cfg.dist_backend}, {cfg.dtype})")
    try:
        t = time.perf_counter()
        engine = HFEngine(model_dir, dtype=engine_dtype, device=device,
                          max_model_len=args.prompt_len + args.new_tokens + 8)
        rep.add(f"HF engine up in {time.perf_counter() - t:.1f}s ({engine_dtype})")
        rep.add("")
        rep.add(f"{'step':>4} {'rollout':>8} {'host':>6} {'handoff':>8} {'train':>7} {'wsync':>7} "
                f"{'total':>7} {'tokens':>7} {'train tok/s':>11} {'loss':>9} {'gnorm':>8} {'peak GiB':>8}")
        rows = []
        for step in range(args.steps):
            r = _one_step(args, step, shape, engine, backend, engine_dtype="float32" if smoke else "bfloat16")
            rows.append(r)
            rep.add(f"{step:>4} {r['rollout_s']:>8.2f} {r['host_s']:>6.3f} {r['handoff_s']:>8.4f} "
                    f"{r['train_s']:>7.2f} {r['weight_sync_s']:>7.2f} {r['total_s']:>7.2f} {r['tokens']:>7} "
                    f"{r['train_tok_s']:>11.0f} {r['loss']:>9.4f} {r['grad_norm']:>8.3f} {r['peak_gib']:>8.2f}")
        _summary(args, rep, rows, backend, smoke)
        engine.shutdown()
    finally:
        backend.close()


def _header(rep: Report, smoke: bool) -> bool:
    """Versions, the GPU and /dev/shm into the report; False if CUDA is missing."""
    import torch
    import transformers

    rep.add(f"areno gpu_check ({'CPU smoke, tiny shape' if smoke else 'GPU, Qwen3-0.6B shape'})")
    rep.add(f"python {platform.python_version()}  torch {torch.__version__}  transformers {transformers.__version__}")
    if not smoke:
        if not torch.cuda.is_available():
            rep.check("cuda available", False, "torch.cuda.is_available() is False")
            return False
        rep.add(f"gpu: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible); "
                f"cuda {torch.version.cuda}; nccl {torch.cuda.nccl.version()}")
    st = os.statvfs("/dev/shm")
    rep.add(f"/dev/shm: {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free")
    return True


def _attention_checks(rep: Report, device: str) -> None:
    """packed == padded log-probs for every attention kernel the device has."""
    from areno.backend.attention import has_flash_attn, has_torch_varlen

    impls = ["sdpa"] + (["flex"] + ["varlen"] * has_torch_varlen() + ["flash_attention_2"] * has_flash_attn()
                        if device == "cuda" else [])
    for impl in impls:
        diff = packed_attention_check(device, impl)
        # a packed forward that leaked across sequences differs by ~0.3 on this model
        tol = 3e-2 if impl in ("varlen", "flash_attention_2") else 1e-3  # bf16 vs fp32
        rep.check(f"packed == padded log-probs ({impl}, cu_seqlens)", diff < tol, f"max diff {diff:.2e}")


def _backend_config(args: argparse.Namespace, model_dir: Path, device: str):
    """FSDP2 at one rank on purpose: the GPU code path multi-GPU runs take."""
    from areno.backend import BackendConfig
    from areno.losses import LossConfig

    smoke = device == "cpu"
    return BackendConfig(
        model_path=str(model_dir), world_size=1, device=device,
        dtype="float32" if smoke else "bfloat16", strategy="fsdp2",
        lr=1e-6, warmup_steps=1, total_steps=args.steps * 2, max_grad_norm=1.0,
        grad_checkpointing=args.grad_checkpointing, ppo_epochs=1, loss=LossConfig(algo="grpo"),
        logprob_chunk_size=4096, startup_timeout_s=900, command_timeout_s=900,
        export_dtype=None if smoke else "bfloat16",  # what a bf16 engine loads; half the bytes
        attn_implementation=args.attn,
    )


def _one_step(args: argparse.Namespace, step: int, shape: dict, engine, backend, engine_dtype: str) -> dict:
    """Rollout, advantages + pack, train, weight sync through export; its timings."""
    from areno.advantages import group_advantages
    from areno.rollout.engine import SamplingConfig
    from areno.split import build_split_pack

    sampling = SamplingConfig(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids, offs = make_prompts(args.prompts, args.prompt_len, shape["vocab_size"], seed=step)
    batch = engine.generate(ids, offs, args.samples, sampling)
    t1 = time.perf_counter()
    adv = group_advantages(rewards_of(batch), batch.group_index, mode="grpo")
    split = build_split_pack(batch, adv, world_size=1, max_tokens=args.micro_tokens,
                             num_minibatches=args.minibatches)
    t2 = time.perf_counter()
    metrics = backend.train(split)
    t3 = time.perf_counter()
    tim = dict(backend.last_timings)
    named, probe = backend.export_weights(engine_dtype=engine_dtype)
    engine.update_weights(named, probe)
    t4 = time.perf_counter()
    handoff = tim["handoff_write_s"] + tim["handoff_map_s"]
    r = dict(step=step, rollout_s=t1 - t0, host_s=t2 - t1, handoff_s=handoff, train_s=t3 - t2 - handoff,
             weight_sync_s=t4 - t3, total_s=t4 - t0, tokens=split.pack.num_tokens,
             loss=metrics[-1]["loss"], grad_norm=metrics[-1]["grad_norm"],
             nan_skipped=sum(m["nan_skipped"] for m in metrics),
             peak_gib=tim.get("peak_gpu_mem_gb", float("nan")),
             export_gather_s=backend.last_timings.get("export_gather_s"),
             export_probe_s=backend.last_timings.get("export_probe_s"))
    r["train_tok_s"] = r["tokens"] / max(r["train_s"], 1e-9)
    return r


def _summary(args: argparse.Namespace, rep: Report, rows: list[dict], backend, smoke: bool) -> None:
    """Means over the steady steps, the checks, and the JSON beside the report."""
    import torch

    steady = rows[1:] or rows
    mean = {k: float(np.mean([r[k] for r in steady])) for k in
            ("rollout_s", "host_s", "handoff_s", "train_s", "weight_sync_s", "total_s", "train_tok_s",
             "export_gather_s", "export_probe_s")}
    rep.add("")
    rep.add(f"mean of steps 1..{len(rows) - 1} (step 0 is warm-up): " + ", ".join(
        f"{k} {v:.3f}" for k, v in mean.items()))
    rep.add(f"trained tokens/s {mean['train_tok_s']:.0f}; end-to-end tokens/s "
            f"{np.mean([r['tokens'] / r['total_s'] for r in steady]):.0f}")
    if not smoke:
        free, total = torch.cuda.mem_get_info()
        rep.add(f"peak GPU memory (backend rank, allocated): {max(r['peak_gib'] for r in rows):.2f} GiB; "
                f"device now {(total - free) / 2**30:.1f} / {total / 2**30:.1f} GiB used")
    rep.check("all losses and grad norms finite", all(np.isfinite([r["loss"], r["grad_norm"]]).all()
                                                      for r in rows))
    rep.check("no skipped steps", all(r["nan_skipped"] == 0 for r in rows))
    rep.check("weight sync probe accepted by the engine every step", True)
    rep.check(f"backend optimizer steps == {args.steps * args.minibatches}",
              backend.step == args.steps * args.minibatches, f"got {backend.step}")
    rep.path.with_suffix(".json").write_text(json.dumps({"rows": rows, "mean": mean}, indent=1) + "\n")


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM (time limit reached)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU (gloo), same code path")
    ap.add_argument("--out", default=None, help="results file (default $OUT/gpu_check.txt or ./gpu_check.txt)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--micro-tokens", type=int, default=None)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--attn", default="auto", choices=["auto", "varlen", "flash_attention_2", "flex", "sdpa"],
                    help="backend attention (backend/attention.py; auto: flash-attn, else torch varlen, else flex)")
    args = ap.parse_args(argv)
    smoke = args.cpu_smoke
    for name, gpu, cpu in (("steps", 4, 2), ("prompts", 16, 4), ("prompt_len", 64, 12), ("new_tokens", 192, 8),
                           ("micro_tokens", 8192, 64)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if smoke else gpu)
    if smoke:
        args.samples = min(args.samples, 4)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    work = Path(tempfile.mkdtemp(prefix="areno-gpu-check-"))
    t = time.perf_counter()
    # `timeout` (gpu_check.sh) sends SIGTERM: unwind, so the backend is shut down and the file says so
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        run(args, rep, work / "run")
    except BaseException as e:  # the results file says why
        rep.check("run completed", False, f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}")
        rep.add(traceback.format_exc())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rep.add(f"wall time {time.perf_counter() - t:.0f}s; {'ALL PASS' if rep.ok else 'SOME CHECKS FAILED'}")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
