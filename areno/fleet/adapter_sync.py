"""The rank side of a LoRA sync (issue 19): gather the trained adapter and load
it into this rank's engine, then prove the engine serves it.

Under LoRA the base weights are frozen and already in the engine; only the
adapter travels (peft's saved names, `get_peft_model_state_dict`). Each rank
gathers the full adapter tensors (FSDP2: `full_tensor()`, a collective every
rank runs in the same order) in the engine's dtype, loads them with the
trainer's sync count as the version, and returns the fingerprint the engine
must report of what it serves, computed from what was sent (rollout.lora):
the worker's SyncCheck compares them exactly, as for full weights, then runs
the log-prob probe when due: the trainer's forward
goes through the peft model and the engine's prompt_logprobs through its
current adapter.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from areno.rollout.lora import adapter_fingerprint_of, adapter_nbytes
from areno.rollout.probe import Fingerprint


def load_adapter(engine: Any, named: Iterable[tuple[str, torch.Tensor]], config: Any,
                 version: int) -> tuple[Fingerprint | None, dict]:
    """`named`: the adapter as (peft saved name, full tensor), e.g. backend.lora's
    `adapter_state` (every rank iterates it to the end: FSDP2 gathers). Copies it
    in the engine's dtype (`engine.adapter_dtype`) and `engine.load_adapter(tensors,
    config, version)`. -> (the fingerprint the engine's `adapter_fingerprint()`
    must equal, None where the engine's is not exact (a TP shard); {adapter_bytes,
    adapter_tensors, gather_s, load_s}). The check itself: weight_sync.SyncCheck."""
    t0 = time.perf_counter()
    dtype = getattr(engine, "adapter_dtype", None)
    with torch.no_grad():
        tensors = {n: t.detach().to(dtype if dtype is not None else t.dtype, copy=True) for n, t in named}
    exact = getattr(engine, "fingerprint_exact", True)
    want = adapter_fingerprint_of(tensors, config) if exact else None  # before the engine may keep them
    t1 = time.perf_counter()
    engine.load_adapter(tensors, config, version)
    return want, {"adapter_bytes": adapter_nbytes(tensors), "adapter_tensors": len(tensors),
                  "gather_s": t1 - t0, "load_s": time.perf_counter() - t1}
