"""Torch backend: N rank processes (FSDP2 or DDP; NCCL on GPU, gloo on CPU) that
train one policy on SplitPacks handed over through shared memory.

    with TorchBackend(BackendConfig(model_path=..., world_size=2)) as backend:
        metrics = backend.train(split)              # one dict per optimizer step
        named, probe = backend.export_weights()     # -> engine.update_weights(named, probe)

Importing this package does not import transformers or touch a GPU.
"""

from areno.backend.config import BackendConfig
from areno.backend.controller import BackendError, TorchBackend

__all__ = ["BackendConfig", "BackendError", "TorchBackend"]
