"""GPU check, the parts the CLI runs cannot show (scripts/gpu_check.sh runs
the CLI itself on the default path):

  1. packed == padded log-probs for every attention kernel the device has;
  2. the transformers engine's peak GPU memory while sampling --new-tokens
     (default 1024) tokens for --rows rows on the Qwen3-0.6B-shaped model that
     gpu_check_cli.py built, against what the old path (every step's scores
     kept, then stacked and log-softmaxed: 3 x rows x steps x vocab x 4 bytes)
     would have added.

    python scripts/gpu_check.py --model-dir DIR --out gpu_check.txt              # one NVIDIA GPU
    python scripts/gpu_check.py --model-dir DIR --cpu-smoke --out smoke.txt      # same logic, CPU

Writes the report and, beside it, gpu_check.json. Exit code 0 when every check
line says PASS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np


QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=2048,
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

    from areno.models.tiny import tiny_model_path

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
    from areno.pack import build_padded_pack, build_train_pack
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
        pad = build_padded_pack(b, np.zeros(6, np.float32))
        lpp, _ = pol(pad.input_ids.long().to(d), pad.position_ids.long().to(d), pad.targets.long().to(d),
                     attention_mask=pad.attention_mask.long().to(d))
    return float((lp[0] - lpp[pad.attention_mask.to(d)]).abs().max().cpu())


def engine_peak(model_dir: Path, device: str, rows: int, prompt_len: int, new_tokens: int) -> dict:
    """Sample `rows` rows of `new_tokens` tokens (EOS ignored) with the bf16
    transformers engine; its peak allocated memory above the loaded weights."""
    import torch

    from areno.rollout.engine import SamplingConfig
    from areno.rollout.hf import HFEngine

    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = HFEngine(model_dir, dtype=dtype, device=device, max_model_len=prompt_len + new_tokens)
    rng = np.random.default_rng(0)
    groups = max(rows // 4, 1)
    ids = rng.integers(3, min(engine.vocab_size, 400), groups * prompt_len).astype(np.int32)
    offsets = np.arange(0, ids.size + 1, prompt_len, dtype=np.int64)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t = time.perf_counter()
    batch = engine.generate(ids, offsets, rows // groups, SamplingConfig(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    n = batch.num_responses
    old_scores = 3 * n * new_tokens * engine.vocab_size * 4  # stacked scores, fp32 copy, log-softmax
    engine.shutdown()
    return dict(rows=int(n), new_tokens=new_tokens, vocab=engine.vocab_size, seconds=seconds,
                tokens=int(batch.num_response_tokens), peak_above_weights_gib=None if peak is None else peak / 2**30,
                old_path_scores_gib=old_scores / 2**30)


def run(args: argparse.Namespace, rep: Report) -> dict:
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if not _header(rep, smoke):
        return {}
    _attention_checks(rep, device)
    r = engine_peak(Path(args.model_dir), device, args.rows, args.prompt_len, args.new_tokens)
    rep.add(f"transformers engine: {r['rows']} rows x {r['new_tokens']} new tokens (vocab {r['vocab']}) "
            f"in {r['seconds']:.1f}s, {r['tokens'] / r['seconds']:.0f} tok/s")
    rep.check(f"engine sampled every token ({r['rows']} x {r['new_tokens']})",
              r["tokens"] == r["rows"] * r["new_tokens"], f"got {r['tokens']}")
    if r["peak_above_weights_gib"] is not None:
        peak, old = r["peak_above_weights_gib"], r["old_path_scores_gib"]
        rep.add(f"peak GPU memory above the engine's weights: {peak:.2f} GiB "
                f"(the old path's scores alone: {old:.1f} GiB)")
        # the KV cache and one step's [rows, vocab] remain; the old path's scores were 3 x rows x steps x vocab
        rep.check("engine peak memory below a tenth of the old path's scores", peak < old / 10,
                  f"{peak:.2f} GiB vs {old:.1f} GiB")
    return {"engine": r}


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


def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM (time limit reached)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="the model gpu_check_cli.py built (DIR/model)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, the same code path")
    ap.add_argument("--out", default=None, help="results file (default $OUT/gpu_check.txt or ./gpu_check.txt)")
    ap.add_argument("--rows", type=int, default=None, help="sampled rows (GPU 64, smoke 8)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per row (GPU 1024, smoke 16)")
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = 8 if args.cpu_smoke else 64
    if args.new_tokens is None:
        args.new_tokens = 16 if args.cpu_smoke else 1024
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    t = time.perf_counter()
    # `timeout` (gpu_check.sh) sends SIGTERM: unwind, so the file says why it stopped
    signal.signal(signal.SIGTERM, _on_sigterm)
    results: dict = {}
    try:
        results = run(args, rep)
    except BaseException as e:  # the results file says why
        rep.check("run completed", False, f"{type(e).__name__}: {' '.join(str(e).split())[:2000]}")
        rep.add(traceback.format_exc())
    rep.add(f"wall time {time.perf_counter() - t:.0f}s; {'ALL PASS' if rep.ok else 'SOME CHECKS FAILED'}")
    results |= {"ok": rep.ok, "checks": [ln for ln in rep.lines if ln.startswith(("PASS", "FAIL"))]}
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
