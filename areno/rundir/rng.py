"""Snapshots of the global RNGs (python, numpy, torch, and the device's), for
checkpoints of the controller and of each rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """python, numpy and torch CPU generators (+ the CUDA one of `device`)."""
    cuda = device is not None and device.type == "cuda"
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if cuda else None}


def set_rng_state(s: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back what rng_state returned (a CUDA state only on a CUDA device)."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(s["cuda"], device)
