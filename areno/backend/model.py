"""Model side of a rank: load the HF model, wrap it (FSDP2 / DDP), and turn a
packed micro-batch into per-token log-probs of its targets.

Log-probs come from the last hidden states through `ChunkedLogProbs`: lm_head,
fp32 log-softmax and the gather run over chunks of `chunk_size` positions, and
backward recomputes each chunk's logits, so fp32 [positions, vocab] logits
exist for at most one chunk at a time (in forward and in backward). Entropy
comes out of the same chunks.

`PolicyModule` wraps the HF model so that the whole computation is the forward
of the module FSDP2 wraps last (the root): its pre-forward hook gathers
embed_tokens / norm / lm_head, which an lm_head used outside the root forward
would miss.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from areno.backend.attention import (
    PACKED_IMPLS,
    auto_impl,
    document_block_mask,
    hf_name,
    length_groups,
    packed_kwargs,
    padded_causal_mask,
    register,
)
from areno.backend.config import BackendConfig
from areno.backend.lora import head_weight

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_attn_implementation(cfg: BackendConfig) -> str:
    """'auto' -> the packed kernel for the device and dtype (see attention.auto_impl)."""
    return auto_impl(cfg.device, cfg.dtype) if cfg.attn_implementation == "auto" else cfg.attn_implementation


def load_hf_model(path: str | os.PathLike, attn_implementation: str, device: torch.device) -> nn.Module:
    """fp32 master weights on `device` (FSDP2 casts to the compute dtype per gather).
    `attn_implementation` is one of attention.PACKED_IMPLS."""
    from transformers import AutoModelForCausalLM

    if attn_implementation not in PACKED_IMPLS:
        raise ValueError(f"attn_implementation {attn_implementation!r}: expected one of {PACKED_IMPLS}")
    register()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=hf_name(attn_implementation)
    )
    model.config.use_cache = False
    # fp32 master weights whatever the checkpoint's dtype
    return model.to(device=device, dtype=torch.float32)


# -- chunked log-probs -------------------------------------------------------
class ChunkedLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N] int64) -> (logp [N], entropy [N]), fp32.

        z = h W^T (fp32),  lse = logsumexp(z),  logp = z[target] - lse,
        entropy = lse - sum_j p_j z_j,  p = softmax(z)

    Backward per chunk, with g / e the incoming grads of logp / entropy:
        dz = g (onehot - p) - e p (z - E_p[z]),   E_p[z] = lse - entropy
    then dh = dz W, dW += dz^T h (accumulated in fp32).

    The GEMMs run in the compute dtype (`compute_dtype`), chosen in forward and
    kept for backward: `.backward()` runs outside autocast, so under `single`/DDP
    bf16 a backward that followed the weights' dtype would do its three N x H x V
    GEMMs in fp32 and recompute logits that differ from those whose logsumexp
    forward saved (issue 17, 2c).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int):  # type: ignore[override]
        # Outputs are fresh [*targets.shape] tensors (not views: FSDP2 hooks the
        # root module's outputs, and a view would lose its pre-backward hook).
        dev = hidden.device
        logp = torch.empty(targets.shape, dtype=torch.float32, device=dev)
        ent = torch.empty(targets.shape, dtype=torch.float32, device=dev)
        h_all, t_all = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        lp_flat, ent_flat = logp.view(-1), ent.view(-1)
        lse_all = torch.empty(t_all.shape[0], dtype=torch.float32, device=dev)
        cd = compute_dtype(hidden, weight)
        w_c = weight.to(cd)
        for a in range(0, t_all.shape[0], chunk_size):
            b = min(a + chunk_size, t_all.shape[0])
            z = F.linear(h_all[a:b].to(cd), w_c).float()
            lse = torch.logsumexp(z, dim=-1)
            p = torch.exp(z - lse[:, None])
            lp_flat[a:b] = z.gather(1, t_all[a:b, None])[:, 0] - lse
            ent_flat[a:b] = lse - (p * z).sum(-1)
            lse_all[a:b] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent)
        ctx.chunk_size, ctx.compute_dtype = chunk_size, cd
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):  # type: ignore[override]
        hidden, weight, targets, lse_all, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_logp is None and g_ent is None:
            return None, None, None, None
        h_all, t_all, ent = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), ent.reshape(-1)
        g_logp = g_logp.reshape(-1).float() if g_logp is not None else None
        g_ent = g_ent.reshape(-1).float() if g_ent is not None else None
        n = t_all.shape[0]
        grad_h = torch.empty_like(h_all) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        cd = ctx.compute_dtype
        w_c = weight.to(cd)  # one cast per backward, as autocast's weight cache gives forward
        for a in range(0, n, ctx.chunk_size):
            b = min(a + ctx.chunk_size, n)
            h = h_all[a:b].to(cd)
            z = F.linear(h, w_c).float()  # the very logits forward's lse came from
            p = torch.exp(z - lse_all[a:b, None])
            dz = torch.zeros_like(z)
            if g_logp is not None:
                dz.addcmul_(p, -g_logp[a:b, None])
                dz.scatter_add_(1, t_all[a:b, None], g_logp[a:b, None])
            if g_ent is not None:
                mean_z = (lse_all[a:b] - ent[a:b])[:, None]
                dz.sub_(g_ent[a:b, None] * p * (z - mean_z))
            dz = dz.to(cd)
            if need_h:
                grad_h[a:b] = _dz_at_w(dz, w_c).to(hidden.dtype)
            if need_w:
                grad_w.add_(dz.t() @ h)
        if grad_h is not None:
            grad_h = grad_h.view(hidden.shape)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None


def _dz_at_w(dz: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dz [n, V] @ w [V, H] in their dtype. On CPU a bf16 GEMM of this layout
    (inner dimension V, both operands row-major) is ~15x slower than the same
    product as w^T @ (dz^T contiguous) (2.6 s vs 0.18 s at n=256, H=576, V=4K,
    one AVX2 thread); on CUDA the plain product is the fast one."""
    if dz.device.type == "cpu" and dz.dtype == torch.bfloat16:
        return (w.t() @ dz.t().contiguous()).t()
    return dz @ w


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The lm_head GEMMs' dtype: autocast's where it is on for this device (it
    would cast F.linear to it), else the weight's (FSDP2 gathers bf16 params)."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., H], weight [V, H], targets [...] -> (logp, entropy), targets' shape, fp32."""
    return ChunkedLogProbs.apply(hidden, weight, targets.long(), int(chunk_size))


# -- the module that FSDP2 / DDP wrap ------------------------------------------
class PolicyModule(nn.Module):
    """forward(input_ids [B, T], position_ids [B, T], targets [B, T],
    attention_mask [B, T] | None, cu_seqlens [S+1] int32 | None, max_seqlen int | None)
    -> (logp [B, T], entropy [B, T]) fp32, of the logits / `temperature` (the
    sampler's, for training; 1 for the weight-sync probe, which engines score at 1).

    Packed layout: B = 1, attention_mask None, `cu_seqlens` (on the device) and
    `max_seqlen` (host int) from the pack: the attention kernel (attention.py)
    computes only within-sequence blocks and reads nothing back from the device.
    Padded layout (the reference tests compare against): attention_mask marks
    real positions.
    """

    def __init__(self, hf: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.chunk_size = chunk_size

    def forward(self, input_ids, position_ids, targets, attention_mask=None, cu_seqlens=None, max_seqlen=None,
                temperature: float = 1.0):
        kw: dict = {}
        if attention_mask is not None:
            attention_mask = padded_causal_mask(attention_mask)  # 4-D: used as is
        else:
            if cu_seqlens is None:  # callers without a pack: derive them (a host sync on GPU)
                cu_seqlens, max_seqlen = cu_seqlens_from_positions(position_ids[0])
            kw = packed_kwargs(cu_seqlens, max_seqlen)
            impl = self.hf.config._attn_implementation
            if impl == hf_name("flex"):
                kw["areno_block_mask"] = document_block_mask(position_ids)
            elif impl == hf_name("sdpa"):  # once per forward, not once per layer
                kw["areno_length_groups"] = length_groups(cu_seqlens)
        out = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False,
            **kw,
        )
        hidden = out.last_hidden_state
        if temperature != 1.0:  # logits / T = (hidden / T) @ W^T: the chunks never hold unscaled logits
            hidden = hidden / temperature
        return chunked_logprobs(hidden, head_weight(self.hf.lm_head), targets, self.chunk_size)


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[L] restarting positions -> (cu_seqlens [S+1] int32, max_seqlen). Reads the
    starts back to the host; the training path passes the pack's instead."""
    L = position_ids.shape[0]
    starts = (position_ids == 0).nonzero()[:, 0].to(torch.int32)
    end = torch.full((1,), L, dtype=torch.int32, device=position_ids.device)
    cu = torch.cat([starts, end])
    return cu, int((cu[1:] - cu[:-1]).max())


def checkpoint_layers(hf: nn.Module) -> int:
    """Activation checkpointing of every decoder layer: under grad, a layer's forward
    runs inside torch.utils.checkpoint (non-reentrant), which keeps only its inputs
    and recomputes the rest in backward. Returns the layers wrapped.

    An explicit wrapper, not transformers' `gradient_checkpointing_enable`: that
    checkpoints only while `self.training` is true, and the policy stays in eval
    mode, so it never did anything. Train mode would flip every `self.training`
    branch of the model (attention_dropout, hidden/resid/embd dropouts under
    family-specific names, MoE router jitter, peft's LoRA dropout) and RL's
    update must stay deterministic; zeroing each by name is whack-a-mole. The
    wrapper leaves the module tree and its state_dict names alone (sync and
    save walk them), sits inside each layer's call (so FSDP2's per-layer hooks
    unshard before the recompute, and layer.compile() compiles it), and no-grad
    passes (old/reference log-probs, the probe) skip it."""
    from torch.utils.checkpoint import checkpoint

    layers = list(hf.model.layers)
    for layer in layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return len(layers)


@dataclass
class Wrapped:
    """root: what forward/backward are called on; policy: the unwrapped PolicyModule."""

    root: nn.Module
    policy: PolicyModule
    strategy: str


def wrap_policy(
    policy: PolicyModule,
    cfg: BackendConfig,
    device: torch.device,
    *,
    trainable: bool = True,
) -> Wrapped:
    """FSDP2 (fully_shard per decoder layer, then the root) or DDP around `policy`;
    'single' (one rank): `policy` as it is."""
    world = torch.distributed.get_world_size()
    strategy = cfg.strategy_for(world)
    if trainable and cfg.grad_checkpointing:
        checkpoint_layers(policy.hf)
    if cfg.compile_layers:
        for layer in policy.hf.model.layers:
            layer.compile()
    if strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = None
        if cfg.dtype != "float32":
            mp = MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.dtype], reduce_dtype=torch.float32)
        kw = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
        for layer in policy.hf.model.layers:
            fully_shard(layer, **kw)
        fully_shard(policy, **kw)
        return Wrapped(policy, policy, "fsdp2")
    if strategy == "single" or not trainable:
        return Wrapped(policy, policy, strategy)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(policy, device_ids=[device.index] if device.type == "cuda" else None)
    return Wrapped(ddp, policy, "ddp")


def autocast_ctx(cfg: BackendConfig, strategy: str):
    """DDP and the plain module have no mixed-precision policy: bf16 compute goes
    through autocast (fp32 weights, bf16 matmuls)."""
    if cfg.dtype != "float32" and strategy != "fsdp2":
        return torch.autocast(device_type=cfg.device, dtype=_DTYPES[cfg.dtype])
    return contextlib.nullcontext()
