"""The rank side of a LoRA sync (issue 19): gather the trained adapter and load
it into this rank's engine, then prove the engine serves it.

Under LoRA the base weights are frozen and already in the engine; only the
adapter travels (peft's saved names, `get_peft_model_state_dict`). Each rank
gathers the full adapter tensors (FSDP2: `full_tensor()`, a collective every
rank runs in the same order) in the engine's dtype, loads them with the
trainer's step as the version, and checks the engine's fingerprint of what it
serves against the same quantity computed from what was sent (rollout.lora):
exact, like `engine_host.verify_fingerprint` for full weights. The log-prob
probe (`RankWorker._probe`) then runs as for full syncs: the trainer's forward
goes through the peft model and the engine's prompt_logprobs through its
current adapter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from areno.rollout.lora import adapter_fingerprint_of, adapter_nbytes
from areno.rollout.probe import check_fingerprint


def sync_adapter(engine: Any, named: Iterable[tuple[str, torch.Tensor]], config: Any, version: int, *,
                 rank: int = 0) -> dict:
    """`named`: the adapter as (peft saved name, full tensor), e.g. backend.lora's
    `adapter_state` (every rank iterates it to the end: FSDP2 gathers). Copies it
    in the engine's dtype (`engine.adapter_dtype`), `engine.load_adapter(tensors,
    config, version)`, and checks the engine's `adapter_fingerprint()` exactly
    (WeightSyncError naming the rank and group otherwise; skipped where the
    engine's fingerprint is not exact, a TP shard).
    Returns {adapter_bytes, adapter_tensors, gather_s, load_s, check_s}."""
    t0 = time.perf_counter()
    dtype = getattr(engine, "adapter_dtype", None)
    with torch.no_grad():
        tensors = {n: t.detach().to(dtype if dtype is not None else t.dtype, copy=True) for n, t in named}
    exact = getattr(engine, "fingerprint_exact", True)
    want = adapter_fingerprint_of(tensors, config) if exact else None  # before the engine may keep them
    t1 = time.perf_counter()
    engine.load_adapter(tensors, config, version)
    t2 = time.perf_counter()
    if want is not None:
        check_fingerprint(engine.adapter_fingerprint(), want, rank)
    return {"adapter_bytes": adapter_nbytes(tensors), "adapter_tensors": len(tensors),
            "gather_s": t1 - t0, "load_s": t2 - t1, "check_s": time.perf_counter() - t2}
