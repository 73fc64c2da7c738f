"""Serving a trained LoRA adapter from HFEngine (issue 19).

The engine's model gets peft's LoRA layers at the first `load_adapter`
(`peft.get_peft_model` on the engine's own model, in place: the model object
that generates, scores prompts and runs the probe is the same one, now with an
active "default" adapter; the adapter params in the engine dtype,
autocast_adapter_dtype=False). Each load copies the tensors into those params,
strictly: the names must be exactly `get_peft_model_state_dict`'s (unknown ->
ValueError, missing -> WeightSyncError). A later adapter must have the first
one's structure (rank, alpha, target modules): the layers are built once.

The base weights are frozen and never sent again, so under LoRA `sleep()` keeps
them: it frees nothing (the transformers engine holds no KV cache between
calls) and only marks the engine asleep. Base-weight pushes still work: the
wrapped layers' weights are found under their HF names (`base_named`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from areno.rollout.lora import (
    check_adapter_names,
    check_config,
    check_version,
    held_fingerprint,
    scaled_b,
)
from areno.rollout.probe import Fingerprint

ADAPTER = "default"


def _structure(config: Any) -> tuple:
    tm = config.target_modules
    tm = tuple(sorted(tm)) if isinstance(tm, (set, list, tuple)) else tm
    return int(config.r), float(config.lora_alpha), tm, bool(getattr(config, "use_rslora", False))


def base_named(model: torch.nn.Module, keep_vars: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state under HF checkpoint names: a LoRA-wrapped layer's
    `x.base_layer.weight` as `x.weight`, the adapter's own tensors left out."""
    for name, t in model.state_dict(keep_vars=keep_vars).items():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), t


class HFAdapters:
    """The adapter state of one HFEngine."""

    def __init__(self, model: torch.nn.Module, max_lora_rank: int) -> None:
        self.model = model
        self.max_lora_rank = int(max_lora_rank)
        self.peft: Any = None  # the PeftModel around `model` (which it changed in place)
        self.structure: tuple | None = None
        self.version: int | None = None
        self._live: dict[str, torch.nn.Parameter] = {}  # peft saved name -> live adapter param

    @property
    def injected(self) -> bool:
        return self.peft is not None

    def load(self, tensors: Mapping[str, torch.Tensor], config: Any, version: int) -> None:
        check_config(config)
        if int(config.r) > self.max_lora_rank:
            raise ValueError(f"LoRA rank {config.r} exceeds the engine's max_lora_rank {self.max_lora_rank}")
        check_version(version, self.version)
        if self.peft is None:
            self._inject(config)
        elif _structure(config) != self.structure:
            raise ValueError(f"LoRA adapter structure changed (rank, alpha, target modules: "
                             f"{_structure(config)} after {self.structure}); the engine's layers are built once")
        check_adapter_names(tensors, set(self._live))
        with torch.no_grad():
            for name, t in tensors.items():
                self._live[name].copy_(t)
        self.version = version

    def _inject(self, config: Any) -> None:
        from peft import get_peft_model
        from peft.utils import get_peft_model_state_dict

        # peft draws A's random init from the global RNG, which in a rank is the
        # trainer's (the update's dropout masks, resumed from a checkpoint): the
        # engine must not move it. The drawn values are overwritten by `load`.
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            peft = get_peft_model(self.model, config, adapter_name=ADAPTER, autocast_adapter_dtype=False)
        self.model.eval()  # the new layers (dropout) come in training mode
        params = dict(peft.named_parameters())
        saved = get_peft_model_state_dict(peft, adapter_name=ADAPTER, save_embedding_layers=False)
        live: dict[str, torch.nn.Parameter] = {}
        for name in saved:
            for kind in ("lora_A", "lora_B"):
                own = name.replace(f".{kind}.weight", f".{kind}.{ADAPTER}.weight")
                if own != name and own in params:
                    live[name] = params[own]
        if len(live) != len(saved):
            raise RuntimeError("peft's saved adapter names do not map onto its parameters")
        self.peft, self._live, self.structure = peft, live, _structure(config)

    @torch.no_grad()
    def fingerprint(self) -> Fingerprint:
        """What the model holds (rollout.lora): each LoRA layer's A and B·scaling
        (peft's own scaling), from the live params; empty before the first load."""
        if self.peft is None or self.version is None:
            return Fingerprint({}, {})
        from peft.tuners.lora import LoraLayer

        held: list[tuple[str, str, torch.Tensor]] = []
        for name, m in self.model.named_modules():
            if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
                held.append((name, "lora_A", m.lora_A[ADAPTER].weight))
                held.append((name, "lora_B", scaled_b(m.lora_B[ADAPTER].weight, m.scaling[ADAPTER])))
        return held_fingerprint(held)
