"""LoRA adapters on the rollout engines: the names, the checks and the exact
fingerprint that both sides (trainer and engine) compute. Imports neither vLLM
nor peft at module level.

An adapter travels as peft saves it: a peft `LoraConfig` and a flat dict of
tensors named as `get_peft_model_state_dict(model)` names them (what
`adapter_model.safetensors` holds), e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

**The adapter fingerprint.** Two parts, both exact up to fp64 summation order
(rollout.probe's slack, n·2^-52 of a sum of n non-negative terms):
  - *sums of squares* as for full weights (rollout.probe), per group: a target
    module's parent and the matrix, e.g. `model.layers.0.self_attn.lora_A`
    (q/k/v/o's A). vLLM packs q/k/v (and gate/up) into one layer with one slot per
    projection and pads each slot to its `max_lora_rank` with zeros; a sum of
    squares reads the padding too (it must stay zero) but is blind to where a value
    sits: a q<->k swap, a transposed or sign-flipped block pass it;
  - *a projection per slot* (`slot_checksum`), which sees layout: for each
    projection's A and B (`model.layers.0.self_attn.q_proj.lora_A projection`),
    sum_ij max(R_ij·X_ij, 0) with R a [rows, cols] fp64 matrix in [-1, 1) drawn
    from a CPU generator seeded by that key, so both sides draw the same R. Each
    product R_ij·X_ij is one correctly rounded fp64 multiply of the same two
    numbers on both sides (X widened exactly from bf16/fp32), and the terms kept
    are non-negative, so only the summation order differs and the relative slack
    is rigorous (a plain Σ R·X can cancel to ~0, where no relative slack holds).
    A value moved to another position or slot, or a flipped sign, meets another
    R_ij: the sum moves by ~1/sqrt(n) of itself, 10^10 times the slack.
vLLM also folds the scaling into B when it registers an adapter (`lora_b *= alpha/r`,
in the engine dtype, `LoRALayerWeights.optimize`), so what both sides read is A
and B·scaling, the product rounded to the engine dtype exactly as vLLM does it
(one torch multiply by the same Python float: deterministic). The transformers
engine keeps B and the scaling apart (peft) and computes the same product from
its live parameters. The trainer's side is `adapter_fingerprint_of`, the engines'
`HFAdapters.fingerprint` and `vllm_lora.served_fingerprint`; all three end in
`held_fingerprint`. The projections are computed on the CPU (an adapter is small:
SmolLM2-135M at rank 8 on every linear is 2.4 M values).
"""

from __future__ import annotations

import hashlib
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
    (None: the tensors' own) holds it: A and B·scaling (see the module docstring)."""
    scaling = lora_scaling(config)
    held: list[tuple[str, str, torch.Tensor]] = []
    for name, t in tensors.items():
        module, kind = adapter_module(name)
        t = t.detach()
        if dtype is not None:
            t = t.to(dtype)
        held.append((module, kind, scaled_b(t, scaling) if kind == "lora_B" else t))
    return held_fingerprint(held)


def projection_key(module: str, kind: str) -> str:
    return f"{module}.{kind} projection"


def _projection(key: str, shape: torch.Size) -> torch.Tensor:
    """R: fp64 in [-1, 1) of `shape`, the same on every host for `key` (a CPU
    generator seeded by a hash of it; Python's hash() is salted per process)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.rand(tuple(shape), generator=g, dtype=torch.float64).mul_(2).sub_(1)


def slot_checksum(key: str, t: torch.Tensor) -> torch.Tensor:
    """0-d fp64 (CPU): sum of max(R·t, 0) over t's elements, R = `_projection(key)`
    (see the module docstring). t: one projection's A [r, in] or B·scaling [out, r]."""
    x = t.detach().to("cpu", torch.float64)
    return (x * _projection(key, x.shape)).clamp_(min=0).sum()


def held_fingerprint(modules: Iterable[tuple[str, str, torch.Tensor]],
                     padded: Iterable[tuple[str, str, torch.Tensor]] | None = None) -> Fingerprint:
    """Both sides' fingerprint. modules: (HF module path of one projection,
    "lora_A" | "lora_B", its values as served: A [r, in], B·scaling [out, r]);
    padded: what the sums of squares read, (module path, kind, values) (vLLM:
    each whole padded slot, under its packed module's path); None: `modules`."""
    modules = list(modules)
    squares = [(fingerprint_item(m, k), sum_squares(t), t.numel()) for m, k, t in
               (modules if padded is None else padded)]
    slots = [(projection_key(m, k), slot_checksum(projection_key(m, k), t), t.numel()) for m, k, t in modules]
    if not squares:
        return Fingerprint({}, {})
    grouped = Fingerprint.of((n, s, k) for (n, _, k), s in
                             zip(squares, torch.stack([s.to("cpu") for _, s, _ in squares]).tolist()))
    sums, counts = dict(grouped.sums), dict(grouped.counts)
    for (key, s, n) in slots:
        sums[key], counts[key] = float(s), n
    return Fingerprint(sums, counts)


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
