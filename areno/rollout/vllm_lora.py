"""Serving a trained LoRA adapter from VLLMEngine (issue 19).

vLLM 0.32 loads an adapter only from a directory: `LoRARequest` has a path and
no tensors, and the worker's `WorkerLoRAManager._load_adapter` always reads
`adapter_config.json` + `adapter_model.safetensors` there
(`PEFTHelper.from_local_dir`, `LoRAModel.from_local_checkpoint`).
`LoRAModel.from_lora_tensors` exists, but only that loader calls it; handing
it tensors would mean registering a LoRAModel behind the worker manager's back
(and its lazy re-load, after an eviction or a base-weight reload, would then
find no files). So each version is written as a peft directory under /dev/shm
(one per engine and version; the previous one is removed once the new one is
served) and added with `add_lora(LoRARequest("areno-v<version>", version + 1,
dir))`. Names are versioned because vLLM keys its prefix cache by adapter name:
a reused name would serve KV computed by the previous adapter. After the add,
the previous version is removed (`remove_lora`), the prefix cache reset, and
every generate / prompt_logprobs passes the current request.

**What is served.** `served_fingerprint` runs on the worker and reads the
layers' stacked slots (`lora_a_stacked` / `lora_b_stacked`, one slot per packed
projection) at the slot the current adapter occupies (`lora_index_to_id`): what
the punica kernels multiply by, B already scaled (rollout.lora): each padded
slot for the sums of squares, its [rank, in] / [out, rank] corner, named by the
packed sub-module it holds, for the layout-aware projections. An adapter
not in a slot (never added, evicted, reset by a base reload) reports nothing.

**Sleep.** Level 2 would discard the base weights, and under LoRA the trainer
never sends them again; the adapter's slots live in the same ("weights") memory
pool. So with an adapter the engine sleeps at level 1 (weights to host memory
and back, KV cache dropped) and, on waking, re-adds the current adapter from its
directory (a fresh copy into a slot), whatever the pool did with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from areno.rollout.lora import (
    check_adapter_names,
    check_config,
    check_version,
    held_fingerprint,
    write_adapter_dir,
)
from areno.rollout.probe import Fingerprint, WeightSyncError

# vLLM's LoRAConfig.max_lora_rank accepts these only (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank` (slots are zero-padded)."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")


def lora_llm_kwargs(max_lora_rank: int) -> dict[str, Any]:
    """LLM(...) arguments for serving one adapter of rank <= max_lora_rank. One
    slot: a new version evicts the old from it (LRU), then the old is removed."""
    return dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(max_lora_rank), max_loras=1,
                max_cpu_loras=2)


def _slots(stacked: Any) -> tuple[torch.Tensor, ...]:
    """A LoRA layer's stacked weights as a tuple of slots: linears keep a tuple (one
    per packed projection), the lm_head's `LogitsProcessorWithLoRA` one tensor."""
    return tuple(stacked) if isinstance(stacked, (tuple, list)) else (stacked,)


def served_fingerprint(worker: Any, lora_id: int | None, rank: int = 0) -> Fingerprint:
    """Run on the worker (`collective_rpc`): the fingerprint of the slot holding
    adapter `lora_id` (of LoRA rank `rank`), every LoRA layer the adapter has
    weights for (see the module docstring); empty if it is in no slot. A packed
    layer's slots are its sub-modules (`packed_modules`: qkv_proj's q/k/v): the
    projection of slot i is keyed by sub-module i's HF path; the sums of squares
    read each whole padded slot."""
    mgr = worker.model_runner.lora_manager._adapter_manager
    if lora_id is None or lora_id not in mgr.lora_index_to_id:
        return Fingerprint({}, {})
    index = mgr.lora_index_to_id.index(lora_id)
    lora_model = mgr.get_adapter(lora_id)
    held: list[tuple[str, str, torch.Tensor]] = []
    padded: list[tuple[str, str, torch.Tensor]] = []
    with torch.no_grad():
        for name, module in mgr.modules.items():
            weights = None if lora_model is None else mgr._get_lora_layer_weights(lora_model, name)
            if not weights:
                continue
            subs = mgr.packed_modules.get(name, [name])
            present = weights.lora_a if isinstance(weights.lora_a, (list, tuple)) else [weights.lora_a]
            for i, (a, b) in enumerate(zip(_slots(module.lora_a_stacked), _slots(module.lora_b_stacked))):
                padded += [(name, "lora_A", a[index]), (name, "lora_B", b[index])]
                if i < len(subs) and i < len(present) and present[i] is not None:
                    held += [(subs[i], "lora_A", a[index, 0, :rank, :]), (subs[i], "lora_B", b[index, 0, :, :rank])]
    return held_fingerprint(held, padded)


def move_requests(llm: Any, core: Any, request: Any) -> None:
    """Every request `core` holds (the in-process engine core) and the worker's
    cached state of each now name `request`'s adapter: a preempted request is
    scheduled again, and put back into the worker's batch, with its own."""
    for r in core.scheduler.requests.values():
        if r.lora_request is not None:
            r.lora_request = request
    llm.collective_rpc(_move_worker_requests, args=(request,))


def _move_worker_requests(worker: Any, request: Any) -> None:
    for state in worker.model_runner.requests.values():
        if state.lora_request is not None:
            state.lora_request = request


class VLLMAdapters:
    """The adapter state of one VLLMEngine: the current request, its directory."""

    def __init__(self, llm: Any, max_lora_rank: int, dtype: torch.dtype) -> None:
        self.llm = llm
        self.max_lora_rank = int(max_lora_rank)
        self.dtype = dtype
        self.request: Any = None  # the LoRARequest every generate passes
        self.version: int | None = None
        self.names: set[str] | None = None  # tensor names of the first adapter: later ones must match
        self.rank: int | None = None  # the served adapter's LoRA rank (its slots are padded beyond it)
        self._dir: Path | None = None
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self._root = base / f"areno-lora-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def load(self, tensors: Mapping[str, torch.Tensor], config: Any, version: int, running: Any = None) -> None:
        """Add the adapter of `version`, then remove the previous one. running: the
        in-process engine core of a load between engine steps (partial rollouts):
        the requests it holds are moved onto the new adapter and preempted, so vLLM
        prefills prompt and tokens again under it (the recompute policy of
        rollout/vllm_inflight.py) before the previous adapter goes."""
        from vllm.lora.request import LoRARequest

        check_config(config)
        if int(config.r) > self.max_lora_rank:
            raise ValueError(f"LoRA rank {config.r} exceeds the engine's max_lora_rank {self.max_lora_rank}")
        check_version(version, self.version)
        names = check_adapter_names(tensors, self.names)
        if not self._root.exists():
            self._root.mkdir(mode=0o700)
        path = write_adapter_dir(self._root / f"v{version}",
                                 {k: v.detach().to(self.dtype) for k, v in tensors.items()}, config)
        request = LoRARequest(f"areno-v{version}", version + 1, str(path))
        try:
            if not self.llm.llm_engine.add_lora(request):
                raise WeightSyncError(f"vLLM did not add adapter {request.lora_name}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        old, old_dir = self.request, self._dir
        self.request, self._dir, self.version, self.names = request, path, version, names
        self.rank = int(config.r)
        if running is not None:
            move_requests(self.llm, running, request)
        if not self.llm.reset_prefix_cache(reset_running_requests=running is not None):
            raise WeightSyncError("vLLM refused to reset its prefix cache (requests still running)")
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        if old_dir is not None:
            shutil.rmtree(old_dir, ignore_errors=True)

    def restore(self) -> None:
        """Put the current adapter back into a slot (after a wake or a base-weight
        reload, which removes every adapter): removed, then added from its dir."""
        if self.request is None:
            return
        engine = self.llm.llm_engine
        engine.remove_lora(self.request.lora_int_id)
        if not engine.add_lora(self.request):
            raise WeightSyncError(f"vLLM did not re-add adapter {self.request.lora_name}")

    def fingerprint(self) -> Fingerprint:
        lora_id = None if self.request is None else self.request.lora_int_id
        rank = 0 if self.rank is None else self.rank
        return self.llm.collective_rpc(served_fingerprint, args=(lora_id, rank))[0]

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
        self._dir = None
