"""Full weights out of the (sharded) policy: for the rollout engine and for checkpoints.

`iter_full_state` walks the HF model's state_dict in a fixed order and gathers
one tensor at a time (FSDP2: `DTensor.full_tensor()`, a collective every rank
joins), so at most one full tensor exists beyond the shards. Names are the HF
model's own state_dict keys (no `module.` / `_orig_mod.` / wrapper prefix), so
vLLM's `load_weights` and `from_pretrained` take them; `lm_head.weight` is
always there (for tied embeddings it is the embedding matrix again; a saved
checkpoint of a tied model leaves it out, as transformers does).

How the tensors reach a rollout engine (in-process or through a shared-memory
region) is weight_sync.py's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from areno.fileperms import honour_umask


# Tokenizer / generation files copied next to saved weights so the directory loads alone.
_AUX_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "areno_tiny.json",
)


def tensor_table(hf: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict key -> the live parameter/buffer (a DTensor under FSDP2), in
    state_dict order, plus lm_head.weight (the tied embedding when tied)."""
    live = dict(hf.named_parameters(remove_duplicate=False)) | dict(hf.named_buffers(remove_duplicate=False))
    table = {name: live[name] for name in hf.state_dict().keys()}
    if "lm_head.weight" not in table:
        table["lm_head.weight"] = hf.get_output_embeddings().weight
    return table


def hf_state_names(hf: nn.Module) -> list[str]:
    """The HF model's state_dict keys, with lm_head.weight guaranteed."""
    return list(tensor_table(hf))


def state_meta(hf: nn.Module, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, global shape) per exported tensor, in export order: what a
    weight sync sends (every tensor in the engines' `dtype`)."""
    return [(name, dtype, tuple(t.shape)) for name, t in tensor_table(hf).items()]


def iter_full_state(hf: nn.Module, names: list[str],
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on the param's device), one at a time. Every rank must
    iterate to the end (FSDP2 gathers are collectives). dtype: a sharded tensor is
    cast to it before its gather (a weight sync into bf16 engines moves half the
    bytes of the fp32 masters; the cast is elementwise, so the result is the
    gathered tensor cast, bit for bit); None gathers as stored (checkpoints)."""
    table = tensor_table(hf)
    with torch.no_grad():
        for name in names:
            t = table[name].detach()
            if hasattr(t, "full_tensor"):
                t = (t if dtype is None or t.dtype == dtype else t.to(dtype)).full_tensor()
            yield name, t


def cpu_skeleton(hf_config, named: Iterator[tuple[str, torch.Tensor]]) -> nn.Module:
    """An fp32 CPU HF model whose tensors ARE the given ones (assign, no copy)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    sd = {n: (t if t.dtype == torch.float32 else t.float()) for n, t in named}
    model.load_state_dict(sd, strict=False, assign=True)
    # assign=True gave lm_head a tensor of its own: tie it back to the embedding
    # (its very values), so save_pretrained writes the matrix once, as the
    # source model has it (SmolLM2-135M: 538 MB, not 651 MB).
    if getattr(hf_config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) are not in any state_dict and were
    # built on meta: rebuild their modules on CPU (HF rotary modules take config).
    for mname, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            fresh = type(mod)(mod.config)
            for bname, b in fresh.named_buffers(recurse=False):
                mod.register_buffer(bname, b, persistent=bname not in mod._non_persistent_buffers_set)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise RuntimeError(f"weights missing for {missing[:5]}")
    return model.eval()


def probe_ids(vocab_size: int, length: int = 16, seed: int = 1234) -> np.ndarray:
    """The fixed probe token sequence: [length] int32 ids spread over the vocabulary."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, length).astype(np.int32)


def _copy_use_cache(src: Path, dst: Path) -> None:
    if not src.is_file():
        return
    use_cache = json.loads(src.read_text()).get("use_cache", True)
    cfg = json.loads(dst.read_text())
    if cfg.get("use_cache") != use_cache:
        cfg["use_cache"] = use_cache
        dst.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_hf_dir(hf_config, named: Iterator[tuple[str, torch.Tensor]], out_dir: Path, src_dir: Path) -> None:
    """Write an HF directory (safetensors + config + tokenizer files) into out_dir."""
    model = cpu_skeleton(hf_config, named)
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained derives generation_config.json from the model config (an eos
    # list [2, 0] becomes 2) and training turned use_cache off: a checkpoint must
    # sample like its source, so the source's files win.
    copy_aux_files(src_dir, out_dir)
    _copy_use_cache(src_dir / "config.json", out_dir / "config.json")
    (out_dir / "areno_export.json").write_text(json.dumps({"source": str(src_dir)}) + "\n")
    honour_umask(out_dir)  # transformers writes model.safetensors 0600


def copy_aux_files(src_dir: Path, out_dir: Path) -> None:
    """The source's tokenizer and generation files, verbatim, into out_dir."""
    for f in _AUX_FILES:
        if (src_dir / f).is_file():
            shutil.copy2(src_dir / f, out_dir / f)
    honour_umask(out_dir)
