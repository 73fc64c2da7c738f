#!/usr/bin/env python
"""vLLM outputs -> RolloutBatch: areno's extraction vs a per-token list reference.

Real vLLM outputs from the tiny local model (default 64 prompts x 8 samples x
256 tokens, ignore_eos), generated twice with the same seeds in one run:

  flat   SamplingParams(flat_logprobs=True): one FlatLogprobs per sequence
         (primitive lists; what areno's engine asks for).
  dicts  the default: one {token_id: Logprob} dict per token.

Extraction paths timed (per generated token, median of --repeats):

  areno       `batch_from_request_outputs` on the flat outputs: per sequence,
              np.asarray of the token-id list and of the log-prob list, then
              one concatenate. O(sequences) Python.
  reference   the usual trainer code on the dict outputs: per token, an int
              appended to a Python list and `logprobs[i][tok].logprob`
              appended to another; np.array over the lists at the end.
  ref-flat    the same list code over the flat outputs' primitive lists
              (separates "dict per token" from "Python loop per token").

The generate wall times of both modes are reported too (one run each, noisy):
vLLM's own per-token Logprob objects are built inside generate, so the flat
format also saves time there. The garbage collector stays enabled (it is in a
real trainer, and the dict path feeds it); gc.collect() runs before each timing.

Usage:
  python scripts/bench_rollout.py                       # full size
  python scripts/bench_rollout.py --prompts 8 --tokens 32 --repeats 3 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def reference_extract(outputs: list, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, flat: bool):
    """What trainers commonly do: Python lists grown per token, arrays at the end."""
    from areno.rollout.batch import RolloutBatch

    ids: list[int] = []
    lps: list[float] = []
    lengths: list[int] = []
    finish: list[int] = []
    group: list[int] = []
    codes = {"stop": 0, "length": 1}
    for p, out in enumerate(outputs):
        for c in out.outputs:
            toks = list(c.token_ids)
            if flat:
                seq_lp = [lp for lp in c.logprobs.logprobs]
            else:
                seq_lp = [c.logprobs[i][t].logprob for i, t in enumerate(toks)]
            ids.extend(toks)
            lps.extend(seq_lp)
            lengths.append(len(toks))
            finish.append(codes.get(c.finish_reason, 2))
            group.append(p)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets,
        response_ids=np.array(ids, dtype=np.int32),
        response_offsets=np.array(offsets, dtype=np.int64),
        response_logprobs=np.array(lps, dtype=np.float32),
        group_index=np.array(group, dtype=np.int64),
        finish_reason=np.array(finish, dtype=np.uint8),
    )


def time_it(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt (n)")
    ap.add_argument("--tokens", type=int, default=256, help="response tokens (ignore_eos)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_results/rollout.json")
    ap.add_argument("--model", default=None, help="HF dir (default: the tiny 'chat' model)")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        print(f"note: --repeats {args.repeats} < 5; medians are rough", file=sys.stderr)

    from areno.rollout import vllm as av  # sets the CPU env defaults before vLLM loads
    from areno.models.tiny import tiny_model_path

    model = args.model or str(tiny_model_path("chat"))
    g = _generate(av, model, args)
    same_tokens = _verify(av, g)
    n_tok = args.prompts * args.samples * args.tokens
    runs = {
        "areno": lambda: av.batch_from_request_outputs(g["flat"], g["ids"], g["offsets"], args.samples),
        "reference": lambda: reference_extract(g["dicts"], g["ids"], g["offsets"], args.samples, flat=False),
        "ref-flat": lambda: reference_extract(g["flat"], g["ids"], g["offsets"], args.samples, flat=True),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleave the paths so drift hits all alike
        for k, fn in runs.items():
            times[k] += time_it(fn, 1)
    g["engine"].shutdown()
    us_tok = {k: statistics.median(v) / n_tok * 1e6 for k, v in times.items()}
    _print_table(av, args, times, us_tok, g, n_tok, same_tokens)
    result = {
        "benchmark": "rollout_extraction",
        "vllm_version": av.vllm.__version__,
        "flat_logprobs_facility": av.flat_logprobs_facility(),
        "model": model,
        "prompts": args.prompts, "samples": args.samples, "tokens_per_response": args.tokens,
        "response_tokens": n_tok, "repeats": args.repeats,
        "seconds": times,
        "median_us_per_token": us_tok,
        "ratio_reference_over_areno": us_tok["reference"] / us_tok["areno"],
        "ratio_ref_flat_over_areno": us_tok["ref-flat"] / us_tok["areno"],
        "generate_seconds": {"flat": g["gen_flat"], "dicts": g["gen_dict"]},
        "same_tokens_in_both_generate_runs": same_tokens,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


def _generate(av, model: str, args: argparse.Namespace) -> dict:
    """One real vLLM generate with flat log-probs and one with per-position dicts
    (same seeds), plus the engine, prompts and generate times."""
    from vllm.inputs import TokensPrompt

    from areno.rollout.engine import SamplingConfig

    P, n, T = args.prompts, args.samples, args.tokens
    max_len = args.prompt_len + T + 1
    kv_bytes = max(64 << 20, 4 * P * n * max_len * 1024)  # tiny model: ~1 KiB KV per token
    eng = av.VLLMEngine(model, dtype="float32", seed=0, max_model_len=max_len, kv_cache_memory_bytes=kv_bytes)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, eng.vocab_size, P * args.prompt_len).astype(np.int32)
    prompt_offsets = np.arange(P + 1, dtype=np.int64) * args.prompt_len
    prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in np.split(prompt_ids, prompt_offsets[1:-1])]
    params_flat = eng._sampling_params(n, SamplingConfig(max_tokens=T, ignore_eos=True, seed=1234), P)
    params_dict = [p.clone() for p in params_flat]
    for p in params_dict:
        p.flat_logprobs = False
    eng.llm.generate(prompts[:2], params_flat[:2], use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    outs_flat = eng.llm.generate(prompts, params_flat, use_tqdm=False)
    gen_flat = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs_dict = eng.llm.generate(prompts, params_dict, use_tqdm=False)
    return dict(engine=eng, ids=prompt_ids, offsets=prompt_offsets, flat=outs_flat, dicts=outs_dict,
                gen_flat=gen_flat, gen_dict=time.perf_counter() - t0, n=n, tokens=P * n * T)


def _verify(av, g: dict) -> bool:
    """areno's extraction == the references'; whether both generate runs sampled alike."""
    ours = av.batch_from_request_outputs(g["flat"], g["ids"], g["offsets"], g["n"])
    ref = reference_extract(g["dicts"], g["ids"], g["offsets"], g["n"], flat=False)
    assert ours.num_response_tokens == g["tokens"], (ours.num_response_tokens, g["tokens"])
    same_tokens = bool(np.array_equal(ours.response_ids, ref.response_ids))
    if same_tokens:  # same seeds -> same samples: the two paths must agree exactly
        np.testing.assert_array_equal(ours.response_offsets, ref.response_offsets)
        np.testing.assert_allclose(ours.response_logprobs, ref.response_logprobs, atol=1e-6)
    ref_flat = reference_extract(g["flat"], g["ids"], g["offsets"], g["n"], flat=True)
    np.testing.assert_array_equal(ref_flat.response_logprobs, ours.response_logprobs)
    return same_tokens


def _print_table(av, args: argparse.Namespace, times: dict, us_tok: dict, g: dict, n_tok: int,
                 same_tokens: bool) -> None:
    print(f"vLLM {av.vllm.__version__}; flat log-probs: {av.flat_logprobs_facility()}")
    print(f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens = {n_tok} response tokens; "
          f"median of {args.repeats}")
    print(f"{'path':<12}{'outputs':<9}{'ms/batch':>10}{'us/token':>10}{'x areno':>9}")
    for k in times:
        fmt = "dicts" if k == "reference" else "flat"
        med = statistics.median(times[k])
        print(f"{k:<12}{fmt:<9}{med * 1e3:>10.2f}{us_tok[k]:>10.4f}{us_tok[k] / us_tok['areno']:>9.1f}")
    print(f"vLLM generate (one run each): flat {g['gen_flat']:.2f} s ({g['gen_flat'] / n_tok * 1e6:.1f} us/token), "
          f"dicts {g['gen_dict']:.2f} s ({g['gen_dict'] / n_tok * 1e6:.1f} us/token)")
    if not same_tokens:
        print("note: the flat and dict runs sampled different tokens (seeded sampling not reproducible here)")


if __name__ == "__main__":
    sys.exit(main())
