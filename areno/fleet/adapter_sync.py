"""A LoRA sync: the trained adapter into an engine, then the proof that the
engine serves it. Colocated, each rank loads its own engine (`load_adapter`
from `adapter_state`); under split placement rank 0 writes the adapter into a
shared-memory region and each engine process loads it from there with the same
`load_adapter` (weight_sync.load_region).

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


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]],
                    dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """(peft saved name, full tensor) -> {name: a copy in `dtype`} (None: the
    tensor's own), what the engine holds and the fingerprint is computed of.
    Every rank iterates `named` to the end (FSDP2 gathers). A copy, not a view:
    an engine may keep what it is given, and a shared-memory region is
    rewritten by a later publish."""
    with torch.no_grad():
        return {n: t.detach().to(dtype if dtype is not None else t.dtype, copy=True) for n, t in named}


def load_adapter(engine: Any, named: Iterable[tuple[str, torch.Tensor]], config: Any,
                 version: int, fingerprint: bool = True, inflight: int | None = None,
                 ) -> tuple[Fingerprint | None, dict]:
    """`named`: the adapter as (peft saved name, full tensor), e.g. backend.lora's
    `adapter_state` (every rank iterates it to the end: FSDP2 gathers) or a
    published region's views (weight_sync.load_region). Copies it in the engine's
    dtype (`engine.adapter_dtype`) and `engine.load_adapter(tensors, config,
    version)`. -> (the fingerprint the engine's `adapter_fingerprint()` must
    equal, None where the engine's is not exact (a TP shard) or `fingerprint` is
    off (the sender computed it: a published region); inflight: the weight version
    of a load between decode steps (partial rollouts); {adapter_bytes,
    adapter_tensors, gather_s, load_s}). The check itself: weight_sync.SyncCheck."""
    t0 = time.perf_counter()
    tensors = adapter_tensors(named, getattr(engine, "adapter_dtype", None))
    exact = fingerprint and getattr(engine, "fingerprint_exact", True)
    want = adapter_fingerprint_of(tensors, config) if exact else None  # before the engine may keep them
    t1 = time.perf_counter()
    engine.load_adapter(tensors, config, version, **({} if inflight is None else {"inflight": inflight}))
    return want, {"adapter_bytes": adapter_nbytes(tensors), "adapter_tensors": len(tensors),
                  "gather_s": t1 - t0, "load_s": time.perf_counter() - t1}
