"""LoRA adapters on the rollout engines: the names, the checks and the exact
fingerprint that both sides (trainer and engine) compute. Imports neither vLLM
nor peft at module level.

An adapter travels as peft saves it: a peft `LoraConfig` and a flat dict of
tensors named as `get_peft_model_state_dict(model)` names them (what
`adapter_model.safetensors` holds), e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

**The adapter fingerprint.** As for full weights (rollout.probe), the fp64 sum
of squares of the values the engine holds, per group. A group is the target
module's parent and the matrix, e.g. `model.layers.0.self_attn.lora_A` (q/k/v/o's
A) and `model.layers.0.self_attn.lora_B`: vLLM packs q/k/v (and gate/up) into one
layer with one slot per projection, within the parent, and pads each slot to its
`max_lora_rank` with zeros; a sum of squares is invariant to both. vLLM also
folds the scaling into B when it registers an adapter (`lora_b *= alpha/r`, in
the engine dtype, `LoRALayerWeights.optimize`), so the quantity both sides sum
is A and B·scaling, the product rounded to the engine dtype exactly as vLLM
does it (one torch multiply by the same Python float: deterministic). The
transformers engine keeps B and the scaling apart (peft) and computes the same
product from its live parameters. Only the summation order differs: the slack is
rollout.probe's (fp64 rounding, n·2^-52 of the group's sum).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from areno.rollout.probe import Fingerprint, WeightSyncError, sum_squares

PEFT_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B"}


def adapter_module(name: str) -> tuple[str, str]:
    """peft tensor name -> (module path in the HF model, "lora_A" | "lora_B"):
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' ->
    ('model.layers.0.self_attn.q_proj', 'lora_A'). ValueError for anything else
    (biases, embeddings' lora_embedding_A/B, modules_to_save: not served)."""
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            return (module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module), kind
    raise ValueError(f"adapter tensor {name!r} is not a LoRA A/B weight (peft's "
                     "'...<module>.lora_A.weight' / '.lora_B.weight'); only linear LoRA layers are served")


def fingerprint_item(module: str, kind: str) -> str:
    """A name whose rollout.probe group is '<parent>.<kind>' (see the module docstring)."""
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{kind}.{leaf}.weight" if parent else f"{kind}.{leaf}.weight"


def lora_scaling(config: Any) -> float:
    """peft's (and vLLM's) scaling of B: alpha/r, alpha/sqrt(r) for rsLoRA."""
    r, alpha = int(config.r), float(config.lora_alpha)
    return alpha / math.sqrt(r) if getattr(config, "use_rslora", False) else alpha / r


def check_config(config: Any) -> None:
    """ValueError for a LoraConfig the engines cannot serve identically."""
    bad = []
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        bad.append("rank_pattern / alpha_pattern (one rank and alpha for every module)")
    if getattr(config, "use_dora", False):
        bad.append("use_dora")
    if getattr(config, "bias", "none") != "none":
        bad.append(f"bias={config.bias!r}")
    if getattr(config, "modules_to_save", None):
        bad.append("modules_to_save")
    if bad:
        raise ValueError("LoRA adapter: the rollout engines do not serve " + ", ".join(bad))
    if int(config.r) < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {config.r}")


def scaled_b(b: torch.Tensor, scaling: float) -> torch.Tensor:
    """B·scaling in B's dtype, as vLLM's `optimize()` computes it (in place there)."""
    return b if scaling == 1 else b * scaling


@torch.no_grad()
def adapter_fingerprint_of(tensors: Mapping[str, torch.Tensor], config: Any,
                           dtype: torch.dtype | None = None) -> Fingerprint:
    """The trainer's side: the fingerprint of an adapter as an engine of `dtype`
    (None: the tensors' own) holds it: sums of squares of A and of B·scaling
    (see the module docstring), one device read."""
    scaling = lora_scaling(config)
    items: list[tuple[str, torch.Tensor, int]] = []
    for name, t in tensors.items():
        module, kind = adapter_module(name)
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        if kind == "lora_B":
            t = scaled_b(t, scaling)
        items.append((fingerprint_item(module, kind), sum_squares(t), t.numel()))
    return _grouped(items)


def _grouped(items: list[tuple[str, torch.Tensor, int]]) -> Fingerprint:
    if not items:
        return Fingerprint({}, {})
    sums = torch.stack([s.to("cpu") for _, s, _ in items]).tolist()
    return Fingerprint.of((n, s, k) for (n, _, k), s in zip(items, sums))


def held_fingerprint(modules: Iterable[tuple[str, str, torch.Tensor]]) -> Fingerprint:
    """The engine's side: (module path, "lora_A" | "lora_B", the values held,
    B already scaled) -> grouped fingerprint."""
    return _grouped([(fingerprint_item(m, k), sum_squares(t), t.numel()) for m, k, t in modules])


def check_adapter_names(names: Iterable[str], expected: set[str] | None = None) -> set[str]:
    """Every name must be a LoRA A/B weight, each module must come with both;
    with `expected` (the engine's adapter, once it has one): the same set.
    Unknown -> ValueError, missing -> WeightSyncError (as full weight pushes)."""
    got = set(names)
    if not got:
        raise WeightSyncError("adapter update has no tensors")
    kinds: dict[str, set[str]] = {}
    for n in got:
        m, k = adapter_module(n)
        kinds.setdefault(m, set()).add(k)
    half = sorted(m for m, k in kinds.items() if len(k) != 2)
    if half:
        raise WeightSyncError(f"adapter update has only one of lora_A / lora_B for {len(half)} "
                              f"module(s), e.g. {half[0]}")
    if expected is not None:
        from areno.rollout.engine import check_weight_names

        check_weight_names(got, expected)
    return got


def check_version(version: int, current: int | None) -> int:
    """Adapter versions (the trainer's step) are ints, >= 0, strictly increasing."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"adapter version must be an int >= 0 (the trainer's step), got {version!r}")
    if current is not None and version <= current:
        raise ValueError(f"adapter version {version} is not newer than the one served ({current}); "
                         "versions must strictly increase (they name the adapter in vLLM's caches)")
    return version


def write_adapter_dir(path: Path, tensors: Mapping[str, torch.Tensor], config: Any) -> Path:
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors)
    at `path` (created; the caller owns and removes it). Returns `path`."""
    from safetensors.torch import save_file

    path.mkdir(mode=0o700, parents=False, exist_ok=False)
    if hasattr(config, "save_pretrained"):  # peft's own adapter_config.json
        config.save_pretrained(str(path))
    else:
        (path / "adapter_config.json").write_text(json.dumps(dict(config), default=str))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    return path


def adapter_nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
