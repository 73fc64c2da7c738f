"""Packed attention that computes only within-sequence blocks.

A packed micro-batch is `[1, L]` positions of back-to-back sequences with
boundaries `cu_seqlens [S+1] int32`. A dense `[L, L]` block-diagonal mask makes
sdpa compute every cross-sequence block, hold O(L^2) memory and miss the flash
kernel (issue 11: 961 ms / 49 GB vs 284 ms / 35 GB for 16K tokens on an H200).
The kernels here see the boundaries instead:

| name (`attn_implementation`) | kernel | where |
| --- | --- | --- |
| `varlen` | `torch.nn.attention.varlen.varlen_attn` (flash, cu_seqlens) | CUDA, torch >= 2.10, bf16/fp16 |
| `flash_attention_2` | flash-attn's varlen, through transformers' own path | CUDA, flash-attn installed |
| `flex` | FlexAttention with a document-causal block mask (compiled on CUDA) | anywhere |
| `sdpa` | one causal sdpa call per distinct sequence length | CPU default (fastest measured there) |
| `eager` | transformers' eager math, one call per sequence | debugging |

They are registered in transformers' `AttentionInterface` under `areno_<name>`
(flash_attention_2 keeps transformers' own). The boundaries reach every layer
as the flash kwargs `cu_seq_lens_q/k` (device tensor) and `max_length_q/k`
(host int, from the pack), so no kernel reads anything back from the device.
No mask function is registered for the `areno_*` names, so transformers builds
no mask at all for them (and does not scan position_ids for restarts).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PACKED_IMPLS: tuple[str, ...] = ("varlen", "flash_attention_2", "flex", "sdpa", "eager")
_REGISTERED_PREFIX = "areno_"


def hf_name(impl: str) -> str:
    """Our implementation name -> the name transformers dispatches on."""
    return impl if impl == "flash_attention_2" else _REGISTERED_PREFIX + impl


def has_torch_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def auto_impl(device: str, dtype: str) -> str:
    """CUDA: flash-attn's varlen if installed, else torch's varlen, else flex;
    flex in float32 (both flash kernels take fp16/bf16 only). CPU: sdpa by
    length groups (measured fastest on CPU; docs/BACKEND.md)."""
    if device == "cuda" and dtype == "float32":
        return "flex"
    if device == "cuda":
        if has_flash_attn():
            return "flash_attention_2"
        return "varlen" if has_torch_varlen() else "flex"
    return "sdpa"


def packed_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict[str, Any]:
    """The kwargs `model(**kw)` forwards to every attention call: the flash
    names, so transformers' flash_attention_2 path uses them as they are."""
    return {
        "cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens,
        "max_length_q": int(max_seqlen), "max_length_k": int(max_seqlen),
    }


# -- the kernels: (module, q, k, v [1, H, L, D], mask, **kw) -> ([1, L, H, D], None)
def _padded_fallback(module, q, k, v, attention_mask, scaling, **kw):
    """No boundaries given: sdpa with the 4-D mask PolicyModule built (padded
    reference layout), or, with no mask at all, one causal sequence per row
    (transformers builds no mask for areno_* names). Tests and checks only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, attention_mask, scaling=scaling,
                                  is_causal=attention_mask is None)


def _seq_bounds(cu: torch.Tensor) -> list[int]:
    """A CPU tensor's values are host memory: read them without a device readback
    (on CUDA, where auto never picks a per-sequence kernel, this syncs)."""
    return cu.numpy().tolist() if cu.device.type == "cpu" else cu.tolist()


@dataclass(frozen=True)
class LengthGroups:
    """The packed sequences grouped by length, so one sdpa call covers a group.

    index[g]: [n_g * len_g] int64 positions of the group's n_g sequences (each
    contiguous); inverse: [L] int64, the packed order from the groups'
    concatenation. Built once per forward (`length_groups`), used by every layer.
    """

    lengths: tuple[int, ...]
    index: tuple[torch.Tensor, ...]
    inverse: torch.Tensor


def length_groups(cu_seqlens: torch.Tensor) -> LengthGroups:
    """cu_seqlens [S+1] -> LengthGroups on its device. O(S) numpy plus one
    index of L entries; reads cu_seqlens from host memory on CPU."""
    cu = np.asarray(_seq_bounds(cu_seqlens), dtype=np.int64)
    lens, starts = np.diff(cu), cu[:-1]
    lengths, index, order = [], [], []
    for w in np.unique(lens).tolist():
        pos = (starts[lens == w][:, None] + np.arange(w)).reshape(-1)
        lengths.append(int(w))
        index.append(torch.from_numpy(pos).to(cu_seqlens.device))
        order.append(pos)
    perm = np.concatenate(order) if order else np.zeros(0, np.int64)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size)
    return LengthGroups(tuple(lengths), tuple(index), torch.from_numpy(inverse).to(cu_seqlens.device))


def sdpa_by_length(module: nn.Module, q, k, v, attention_mask=None, *, scaling=None,
                   cu_seq_lens_q=None, areno_length_groups=None, **kw):
    """One causal sdpa call per distinct sequence length, over all sequences of
    that length as a batch: work and memory O(sum len_s^2), no mask, no padding,
    and as many calls as lengths rather than sequences (an RL batch of short
    samples has few lengths and many sequences)."""
    if cu_seq_lens_q is None:
        return _padded_fallback(module, q, k, v, attention_mask, scaling)
    groups = areno_length_groups or length_groups(cu_seq_lens_q)
    gqa = q.shape[1] != k.shape[1]
    out = []
    for w, idx in zip(groups.lengths, groups.index):
        # [1, H, L, D] -> [n, H, w, D]: the group's sequences as a batch
        qg, kg, vg = (x[0].index_select(1, idx).unflatten(1, (-1, w)).transpose(0, 1) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scaling, enable_gqa=gqa)
        out.append(o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3]))  # [n * w, H, D]
    return torch.cat(out).index_select(0, groups.inverse)[None], None


def eager_per_sequence(module: nn.Module, q, k, v, attention_mask=None, *, scaling=None,
                       cu_seq_lens_q=None, **kw):
    """transformers' eager attention, one sequence at a time (debugging)."""
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    if cu_seq_lens_q is None:
        return _padded_fallback(module, q, k, v, attention_mask, scaling)
    bounds = _seq_bounds(cu_seq_lens_q)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        causal = torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        o, _ = eager_attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                       causal[None, None], scaling=scaling, dropout=0.0)
        out.append(o)
    return torch.cat(out, dim=1), None


@dataclass(frozen=True)
class VarlenSignature:
    """What the installed `varlen_attn` takes (tests/varlen_signatures.py holds
    the three as released): torch 2.10 `is_causal` and no `scale`; 2.11
    keyword-only `scale` and `window_size` ((-1, 0) = causal); 2.13 adds
    `enable_gqa` (K/V with fewer heads than Q, without a copy)."""

    causal_by_window: bool
    has_scale: bool
    has_gqa: bool


# The parameter names of each released `varlen_attn` the adapter was written and
# tested against (tests/varlen_signatures.py): torch 2.10, 2.11, 2.13.
KNOWN_VARLEN_PARAMETERS: tuple[tuple[str, ...], ...] = (
    ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "return_aux"),
    ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size"),
    ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux", "scale", "window_size",
     "enable_gqa", "seqused_k", "block_table", "num_splits"),
)


def varlen_known(fn) -> bool:
    """Whether `fn`'s parameters are those of a release the adapter knows."""
    return tuple(inspect.signature(fn).parameters) in KNOWN_VARLEN_PARAMETERS


@functools.lru_cache(maxsize=4)
def varlen_signature(fn) -> VarlenSignature:
    """Read once per function object (not once per layer call); an unknown
    signature warns once (run.log): the adapter goes by parameter names, which a
    new release may keep while changing what they mean."""
    params = inspect.signature(fn).parameters
    if not varlen_known(fn):
        warnings.warn(f"areno: torch {torch.__version__}'s varlen_attn{inspect.signature(fn)} is not one of "
                      "the signatures areno was tested with (torch 2.10, 2.11, 2.13); packed attention adapts "
                      "by parameter name: watch train/logprob_diff, or use --attn-implementation flex",
                      RuntimeWarning, stacklevel=2)
    return VarlenSignature("window_size" in params, "scale" in params, "enable_gqa" in params)


def describe_auto(device: str, dtype: str) -> tuple[bool, str]:
    """(known, what `auto` runs for packed attention on `device` in `dtype`), for
    `areno check`; known is False for a varlen_attn of an unknown signature."""
    impl = auto_impl(device, dtype)
    if impl == "flash_attention_2":
        import flash_attn

        return True, f"flash-attn {flash_attn.__version__}'s varlen kernel (flash_attention_2)"
    if impl == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        known = varlen_known(varlen_attn)
        return known, (f"torch {torch.__version__}'s varlen_attn (flash)"
                       + ("" if known else ": a signature areno was not tested with"))
    if impl == "flex":
        compiled = " (compiled)" if device == "cuda" else ""
        return True, f"FlexAttention with a document-causal block mask{compiled}"
    return True, "one causal sdpa call per sequence length"


_HALF = (torch.float16, torch.bfloat16)


def flash_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The one dtype torch's flash kernels take for q, k and v (fp16/bf16: they
    have no autocast rule). Under autocast (`single`/DDP in bf16, fp32 masters)
    Llama/Qwen3 RMSNorm returns `weight * h.to(input_dtype)`, so q and k arrive
    fp32 and v bf16: autocast's dtype, as transformers' flash path picks
    (`integrations/flash_attention.get_target_dtype`). Without autocast (FSDP2's
    bf16 params) they already share a half dtype."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in _HALF:
        return torch.get_autocast_dtype(dev)
    half = [x.dtype for x in (q, k, v) if x.dtype in _HALF]
    if not half:
        raise ValueError(f"varlen attention needs fp16/bf16 inputs, got {q.dtype} (fp32 compute: use flex or sdpa)")
    return half[0]


def varlen(module: nn.Module, q, k, v, attention_mask=None, *, scaling=None,
           cu_seq_lens_q=None, max_length_q=None, **kw):
    """torch's flash varlen: q [1, Hq, L, D], k/v [1, Hkv, L, D] -> [1, L, Hq, D],
    causal, adapted to the installed signature (`varlen_signature`): `scale` where
    it exists, else q pre-scaled when the model's scale is not 1/sqrt(D);
    `enable_gqa` where it exists, else each KV head repeated for its group."""
    if cu_seq_lens_q is None:
        return _padded_fallback(module, q, k, v, attention_mask, scaling)
    from torch.nn.attention import varlen as tv

    fn = tv.varlen_attn
    sig = varlen_signature(fn)
    dt, d = flash_dtype(q, k, v), q.shape[-1]
    scale = d ** -0.5 if scaling is None else float(scaling)
    opts: dict = {"window_size": (-1, 0)} if sig.causal_by_window else {"is_causal": True}
    if sig.has_scale:
        opts["scale"] = scale
    elif not math.isclose(scale, d ** -0.5, rel_tol=1e-6):
        q = q * (scale * d ** 0.5)  # the kernel's fixed 1/sqrt(D) then gives the model's scale
    qt, kt, vt = (x[0].transpose(0, 1).to(dt) for x in (q, k, v))  # [L, H, D]
    if q.shape[1] != k.shape[1]:
        if sig.has_gqa:
            opts["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    out = fn(qt, kt, vt, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **opts)
    return out[None], None


_compiled_flex = None


def _flex_fn(device: torch.device):
    """Compiled on CUDA (fused kernel); eager elsewhere (torch's unfused math)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def document_block_mask(position_ids: torch.Tensor):
    """[1, L] restarting positions -> BlockMask: query i sees key j iff both sit in
    the same sequence (same start i - position_ids[i]) and j <= i. Built on the
    device from position_ids, so no host sync; one per micro-batch."""
    from torch.nn.attention.flex_attention import create_block_mask

    L = position_ids.shape[-1]
    start = torch.arange(L, device=position_ids.device) - position_ids[0]

    def doc_causal(b, h, i, j):
        return (start[i] == start[j]) & (j <= i)

    # compiled on CUDA: eager create_block_mask materialises a dense [L, L] mask first
    return create_block_mask(doc_causal, 1, None, L, L, device=position_ids.device,
                             _compile=position_ids.is_cuda)


def flex(module: nn.Module, q, k, v, attention_mask=None, *, scaling=None,
         cu_seq_lens_q=None, areno_block_mask=None, **kw):
    """FlexAttention over the document-causal block mask PolicyModule built."""
    if areno_block_mask is None:
        return _padded_fallback(module, q, k, v, attention_mask, scaling)
    out = _flex_fn(q.device)(q, k, v, block_mask=areno_block_mask, scale=scaling,
                             enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2), None


_KERNELS = {"varlen": varlen, "flex": flex, "sdpa": sdpa_by_length, "eager": eager_per_sequence}


def register() -> None:
    """Make `areno_<name>` valid `attn_implementation`s (idempotent)."""
    from transformers import AttentionInterface

    for name, fn in _KERNELS.items():
        AttentionInterface.register(hf_name(name), fn)


def padded_causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] real-position mask -> [B, 1, T, T] bool (key real and j <= i), the
    reference padded layout's mask (transformers builds none for areno_* names)."""
    T = attention_mask.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]
