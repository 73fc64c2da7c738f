"""Torch backend: N rank processes (FSDP2 or DDP; NCCL on GPU, gloo on CPU) that
train one policy on SplitPacks handed over through shared memory.

    with TorchBackend(BackendConfig(model_path=..., world_size=2)) as backend:
        metrics = backend.train(split)              # one dict per optimizer step
        backend.sync_weights()                      # each rank's own engine, in-process
        region = backend.publish_weights()          # or: shared memory, for an engine elsewhere
        weight_sync.load_region(engine, region, SyncCheck(...))   # in that engine's process

Importing this package does not import transformers or touch a GPU, and its
names are looked up lazily, so `areno.backend.launch` starts ranks before the
controller has imported torch (runtime/early.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"BackendConfig": "areno.backend.config", "BackendError": "areno.procs.errors",
          "TorchBackend": "areno.backend.controller"}
__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'areno.backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
