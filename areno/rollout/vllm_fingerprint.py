"""What a vLLM model holds, as the weight-sync fingerprint (rollout.probe) sees it,
and the checkpoint tensor names a weight push is checked against.

Runs on the engine's worker, through `LLM.apply_model` (the engine lives in the
rank's process: external_launcher, or the in-process engine core on CPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from areno.models.directory import local_model_dir
from areno.rollout.probe import Fingerprint, sum_squares

log = logging.getLogger("areno.rollout.vllm")


@torch.no_grad()
def held_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Fingerprint of a vLLM model, run on its worker (`LLM.apply_model`).

    Every parameter under every name it has (a tied lm_head counts as the
    embedding again, as the trainer sends it). Buffers are left out: they are
    derived (rotary cos/sin, attention scales), not loaded. Where vLLM keeps a
    linear layer's weight as a parameter (GPU) its values are read as stored
    (fused, vocabulary-padded with zeros: invariant, see rollout.probe). Where
    it re-packed the weight into a kernel's own buffer and left an empty
    parameter (CPU: oneDNN / sgl packing), the weight is read back through that
    kernel: the layer's linear applied to an identity [K, K] in the layer's
    dtype gives W^T exactly (one product 1·w per output, the rest zeros), so
    what is summed is what the kernel multiplies by (SmolLM2-135M on 2 CPU
    cores: 2.2 s bf16, 6.8 s fp32; the GPU reads parameters, no GEMM).
    """
    from vllm.model_executor.layers.linear import LinearBase

    items: list[tuple[str, torch.Tensor, int]] = []
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            t = p
            if pname == "weight" and p.numel() == 0 and isinstance(module, LinearBase):
                eye = torch.eye(module.input_size_per_partition, dtype=p.dtype, device=p.device)
                t = module.quant_method.apply(module, eye, None)
            items.append((f"{mname}.{pname}" if mname else pname, sum_squares(t), t.numel()))
    sums = torch.stack([s for _, s, _ in items]).cpu().tolist()
    return Fingerprint.of((n, s, k) for (n, _, k), s in zip(items, sums))


def checkpoint_names(model_config: Any) -> tuple[set[str] | None, set[str]]:
    """Tensor names of the checkpoint vLLM loaded (read from the safetensors
    headers), used to check weight pushes by name: a local dir, or a hub id's
    snapshot in the HF cache, where vLLM has just loaded it from; None if neither."""
    path = local_model_dir(str(model_config.model))
    files = sorted(path.glob("*.safetensors")) if path is not None else []
    if not files:
        log.warning("areno: cannot list the checkpoint's tensors in %s; weight pushes are not name-checked",
                    model_config.model)
        return None, set()
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    hf = model_config.hf_config
    tied = bool(getattr(hf, "tie_word_embeddings", False) or getattr(hf.get_text_config(), "tie_word_embeddings", False))
    optional = {"lm_head.weight"} if tied else set()
    names -= optional
    # Non-persistent buffers some exporters include; vLLM skips them.
    optional |= {n for n in names if n.endswith("rotary_emb.inv_freq")}
    names -= optional
    return names, optional
