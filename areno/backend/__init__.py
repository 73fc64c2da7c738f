"""Torch training backend: rank processes, FSDP2/DDP, shared-memory hand-off."""
