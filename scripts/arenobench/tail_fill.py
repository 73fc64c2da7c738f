"""Tail fill on the real engine (issue 39): one engine process (vLLM, or the
transformers one with --engine hf; CPU, the tiny chat model), `rounds` rollouts
queued at once, each with a long tail (7 of 8 prompts long enough to be cut at
--max-len after 8 tokens, one short prompt running to --max-tokens). Without a
version (the default mode) the engine runs them one after another; with one
(--partial-rollouts) the queued round joins the running one's generation loop
as its tail drains (fleet/tail_fill.py).

    PYTHONPATH=.:scripts python -m arenobench.tail_fill [--rounds 6] [--engine hf] [--max-len 64 --max-tokens 48]

Prints generated tokens/s of both (alternated on one engine process, medians) and
their ratio (no trainer: the engine alone).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

SHORT, PROMPTS = 8, 8


def prompts(max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """PROMPTS prompts: all but the last cut at max_len after SHORT tokens."""
    lengths = [max_len - SHORT] * (PROMPTS - 1) + [4]
    ids = np.concatenate([3 + (np.arange(n) * 7 + i) % 300 for i, n in enumerate(lengths)]).astype(np.int32)
    return ids, np.concatenate([[0], np.cumsum(lengths)])


def measure(model: Path, rounds: int, n: int, repeats: int, kind: str = "vllm", max_len: int = 256,
            max_tokens: int = 96) -> dict[str, list[dict]]:
    """Both modes, alternated `repeats` times on one engine process (the host's
    other load hits both alike) -> per mode, one record per repeat."""
    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.fleet.engine_procs import EngineProcs
    from areno.fleet.engines import ProcEngines
    from areno.rollout.engine import SamplingConfig
    from areno.rollout.factory import EngineSpec

    cfg = BackendConfig(model_path=str(model), world_size=1, rollout_world_size=1,
                        engine=EngineSpec(kind=kind, fallback=False, max_model_len=max_len,
                                          kv_cache_bytes=64 << 20))
    # No seed: vLLM on CPU cannot rewind a seeded request's generator when a chunked
    # prefill discards its token (gpu_model_runner: "CPU Generator does not use offset").
    sampling = SamplingConfig(max_tokens=max_tokens, seed=None, ignore_eos=True)
    out: dict[str, list[dict]] = {"sequential": [], "tail fill": []}
    with TorchBackend(cfg) as be, EngineProcs(cfg.engine_procs()) as fleet:
        engines = ProcEngines(fleet, be)
        engines.start_rollout(*prompts(max_len), n, sampling, None).collect()  # warm-up
        for _ in range(repeats):
            for mode, version in (("sequential", {}), ("tail fill", {"version": 0})):
                t0 = time.perf_counter()
                pend = [engines.start_rollout(*prompts(max_len), n, sampling, None, **version) for _ in range(rounds)]
                infos = [p.collect() for p in pend]
                wall = time.perf_counter() - t0
                tokens = sum(int(p.sink.merge()[0].response_ids.size) for p in pend)
                out[mode].append({"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                                  "tail_filled": sum(i.get("tail_filled", 0) for i in infos)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="alternations of the two modes")
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--max-len", type=int, default=256, help="the context: the long prompts' width")
    ap.add_argument("--max-tokens", type=int, default=96, help="the short prompt's samples' length")
    args = ap.parse_args(argv)
    from areno.models.tiny import tiny_model_path

    with tempfile.TemporaryDirectory(prefix="areno-tailfill-") as d:
        runs = measure(tiny_model_path("chat", cache_dir=Path(d)), args.rounds, args.n, args.repeats, args.engine,
                       args.max_len, args.max_tokens)
    med = {m: float(np.median([r["tokens_per_s"] for r in rs])) for m, rs in runs.items()}
    for mode, rs in runs.items():
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in rs)
        print(f"{mode}: {rs[0]['tokens']} tokens, wall {walls} s, median {med[mode]:.0f} tok/s, "
              f"tail_filled {rs[0]['tail_filled']}")
    print(f"ratio (medians): {med['tail fill'] / med['sequential']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
