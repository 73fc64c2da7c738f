"""Weight-sync scenarios on one in-process rank (run as a script by
tests/test_engines.py, so its process group and engine stay out of pytest's
process). Prints one JSON object: scenario -> "ok" | the error message, and
"probed": whether each successful sync ran the probe.

usage: python tests/probe_scenarios.py MODEL_DIR ENGINE DTYPE PORT
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model: str, kind: str, dtype: str, port: str) -> dict[str, str]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from areno.backend.config import BackendConfig
    from areno.rollout.factory import EngineSpec
    from areno.backend.weights import probe_ids
    from areno.backend.worker import RankWorker

    cfg = BackendConfig(model_path=model, world_size=1, dtype=dtype,
                        engine=EngineSpec(kind=kind, dtype=dtype, max_model_len=64, kv_cache_bytes=64 << 20))
    w = RankWorker(cfg)
    ids = probe_ids(w.vocab_size)
    load = w.engine.load_weights
    out: dict = {"probed": []}  # per successful sync: did it run the probe?

    def attempt(name: str) -> None:
        try:
            reply = w.cmd_sync_weights(ids)
            out[name] = "ok"
            out["probed"].append("probe_diff" in reply)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"

    attempt("correct")
    w.engine.load_weights = lambda named: load(
        (n, t * 1.01 if n == "model.layers.1.self_attn.o_proj.weight" else t) for n, t in named)
    attempt("corrupted")
    w.engine.load_weights = load
    attempt("correct_again")
    # One AdamW step's worth of change at the demo's lr (|update| = lr per element on
    # the first step); the engine keeps the previous weights.
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in w.hf.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shard
            local.add_(3e-4 * torch.sign(torch.randn(local.shape, generator=g)))
    w.engine.load_weights = lambda named: [None for _ in named]
    attempt("stale")
    w.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:5])))
