"""Torch backend: N rank processes (FSDP2 or DDP; NCCL on GPU, gloo on CPU) that
train one policy on SplitPacks handed over through shared memory.

    with TorchBackend(BackendConfig(model_path=..., world_size=2)) as backend:
        metrics = backend.train(split)              # one dict per optimizer step
        backend.sync_weights()                      # each rank's own engine, in-process
        region = backend.publish_weights()          # or: shared memory, for an engine elsewhere
        weight_sync.load_region(engine, region, SyncCheck(...))   # in that engine's process

Importing this package does not import transformers or touch a GPU.
"""

from areno.backend.config import BackendConfig
from areno.backend.controller import BackendError, TorchBackend

__all__ = ["BackendConfig", "BackendError", "TorchBackend"]
