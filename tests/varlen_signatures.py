"""CPU stand-ins for `torch.nn.attention.varlen.varlen_attn` of torch 2.10, 2.11
and 2.13: each has that release's exact signature, asserts what the CUDA flash
kernel behind it requires, then computes causal attention per sequence with sdpa
in the dtype it was given (so results compare with the sdpa path).

Signatures, copied from:
- 2.10: https://docs.pytorch.org/docs/stable/nn.attention.varlen.html as served
  for 2.10 (the first release with the module; the 2.9 branch was cut before the
  varlen API PR #164502 of 2025-10-15), and the 2.10 source text the search
  index holds (`def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q,
  max_k, is_causal: bool = False, return_aux: AuxRequest | None = None)`):
  no `scale`, no GQA flag.
- 2.11: https://docs.pytorch.org/docs/main/nn.attention.varlen.html after PR
  #172245 (2026-01, `is_causal` -> keyword-only `window_size`) and before the
  inference keywords of PRs #175897/#175924 (2026-03) and `enable_gqa` of PR
  #179468 (2026-04), which came after the 2.11 branch cut.
- 2.13: the installed torch's source, verbatim (a test checks it still is).

What the flash kernel requires (aten `_flash_attention_forward`, FA2
`mha_varlen_fwd`): q, k, v of one dtype, fp16 or bf16 (there is no autocast
rule for it, so nothing casts them); [T, H, D] with a unit last stride; int32
cu_seqlens. The 2.13 wrapper raises on unequal heads without `enable_gqa`; for
2.10/2.11 the stand-ins require equal heads, the layout areno sends them.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)


class AuxRequest(NamedTuple):
    lse: bool = False


def kernel(calls: list, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, causal: bool,
           scale: float | None, gqa: bool) -> torch.Tensor:
    """The flash kernel's input contract, then per-sequence causal sdpa in its dtype."""
    assert causal, "areno's packed attention is causal"
    assert query.dtype == key.dtype == value.dtype, f"flash needs one dtype: {query.dtype} {key.dtype} {value.dtype}"
    assert query.dtype in HALF, f"flash takes fp16/bf16 only, got {query.dtype}"
    assert query.dim() == key.dim() == value.dim() == 3
    assert all(x.stride(-1) == 1 for x in (query, key, value)), "flash needs a unit last stride"
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and cu_seq_q is cu_seq_k and max_q == max_k
    hq, hk = query.shape[1], key.shape[1]
    assert hq == hk or (gqa and hq % hk == 0), f"heads q={hq} kv={hk} (enable_gqa={gqa})"
    calls.append({"dtype": query.dtype, "heads": (hq, hk), "scale": scale, "max_q": max_q})
    cu = cu_seq_q.tolist()
    outs = [F.scaled_dot_product_attention(query[a:b].transpose(0, 1), key[a:b].transpose(0, 1),
                                           value[a:b].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=hq != hk).transpose(0, 1)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs)


def make(version: str, calls: list):
    """The stand-in for `version` ('2.10', '2.11', '2.13'), recording into `calls`."""

    def varlen_attn_2_10(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        is_causal: bool = False,
        return_aux: AuxRequest | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return kernel(calls, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                      causal=is_causal, scale=None, gqa=False)

    def varlen_attn_2_11(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        return_aux: AuxRequest | None = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        is_causal = window_size == (-1, 0)  # as torch does: a list [-1, 0] is not causal
        return kernel(calls, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                      causal=is_causal, scale=scale, gqa=False)

    def varlen_attn_2_13(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor | None,
        max_q: int,
        max_k: int,
        *,
        return_aux: AuxRequest | None = None,
        scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        enable_gqa: bool = False,
        seqused_k: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not enable_gqa and query.size(1) != key.size(1):
            raise ValueError("Expect query and key/value to have the same number of heads")
        is_causal = window_size == (-1, 0)
        return kernel(calls, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                      causal=is_causal, scale=scale, gqa=enable_gqa)

    return {"2.10": varlen_attn_2_10, "2.11": varlen_attn_2_11, "2.13": varlen_attn_2_13}[version]


VERSIONS = ("2.10", "2.11", "2.13")


def parameter_names(fn) -> list[tuple[str, str]]:
    """(name, kind) of each parameter: what the adapter reads from a signature."""
    return [(n, p.kind.name) for n, p in inspect.signature(fn).parameters.items()]
