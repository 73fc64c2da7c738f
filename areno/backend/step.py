"""One rank's share of `TorchBackend.train`: epochs x mini-batches x micro-batches.

Every metric of an optimizer step stays on the device until the end of the
step, where the rank all-gathers one stacked vector (sums and maxima), reduces
it on the device and reads it back with ONE device-to-host copy
(`Tensor.tolist`). That readback happens after gradient clipping and before
`optimizer.step()`, so the host sees the grad norm and the loss and decides
there whether to step or to skip a non-finite update: no second sync. All
ranks read the same reduced values, so they all decide the same way.

How each metric is reduced (sum, token mean, max) is declared once, in
`areno/metrics.py`.

The loss of each micro-batch is the weighted SUM from `losses.compute_loss`
(weights normalised over the whole mini-batch); DDP and FSDP average gradients
over R ranks, so each rank backpropagates R * loss.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areno.backend.config import BackendConfig
from areno.backend.handoff import LocalPack
from areno.backend.hooks import RankHooks
from areno.backend.lora import adapters_disabled, dropout_active
from areno.backend.model import Wrapped, autocast_ctx
from areno.losses import LossInputs, compute_loss
from areno.metrics import DEVICE_METRICS, DEVICE_SUMS, METRICS, finalize_step
from areno.pack import TrainPack

# Accumulated over micro-batches; the optimizer's metrics (grad_norm, lr) are set
# once per step, after clipping, so they get no accumulator.
ACCUMULATED: tuple[str, ...] = tuple(k for k in DEVICE_METRICS if METRICS[k].source != "optimizer")


class NonFiniteStepsError(RuntimeError):
    """max_nan_steps optimizer steps in a row had a non-finite loss or grad norm."""


@dataclass
class Micro:
    """One micro-batch on the device. Packed: [1, L] inputs; [L] per-token tensors."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor
    seq_weights: torch.Tensor
    cu_seqlens: torch.Tensor  # [S+1] int32 on the device, for the attention kernel
    max_seqlen: int           # host int from the pack: no device readback per forward
    num_tokens: int
    num_seqs: int


def adamw_kwargs(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation by device. CPU: fused keeps the step counters on the
    device, so the step makes no .item() call at all. CUDA: foreach (the
    FSDP2-tested path); its step counters live on the host, so their .item() is
    no device sync."""
    return {"fused": True} if device.type == "cpu" else {"foreach": True}


def to_device(tp: TrainPack, device: torch.device) -> Micro:
    """Views of shared memory -> device tensors. An empty micro-batch becomes a
    1-token dummy with zero weight, so every rank runs the same number of
    forward/backward passes (collectives line up) and it adds exactly 0."""
    nb = device.type == "cuda"
    if tp.num_tokens == 0:
        z = torch.zeros(1, dtype=torch.long, device=device)
        return Micro(
            input_ids=z[None], position_ids=z[None], targets=z,
            loss_mask=torch.zeros(1, dtype=torch.bool, device=device),
            rollout_logprobs=torch.zeros(1, device=device), advantages=torch.zeros(1, device=device),
            seq_index=z, seq_weights=torch.zeros(1, device=device),
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device), max_seqlen=1,
            num_tokens=0, num_seqs=0,
        )
    return Micro(
        input_ids=tp.input_ids.to(device, torch.long, non_blocking=nb)[None],
        position_ids=tp.position_ids.to(device, torch.long, non_blocking=nb)[None],
        targets=tp.targets.to(device, torch.long, non_blocking=nb),
        loss_mask=tp.loss_mask.to(device, non_blocking=nb),
        rollout_logprobs=tp.old_logprobs.to(device, non_blocking=nb),
        advantages=tp.advantages.to(device, non_blocking=nb),
        seq_index=tp.local_seq_index().to(device, torch.long, non_blocking=nb),
        seq_weights=tp.seq_weights.to(device, non_blocking=nb),
        cu_seqlens=tp.cu_seqlens.to(device, torch.int32, non_blocking=nb),
        max_seqlen=tp.max_seqlen,
        num_tokens=tp.num_tokens,
        num_seqs=tp.num_seqs,
    )


def forward_logprobs(w: Wrapped, cfg: BackendConfig, mb: Micro) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [L], entropy [L]) fp32 of a packed micro-batch (through the wrapped root)."""
    with autocast_ctx(cfg, w.strategy):
        lp, ent = w.root(mb.input_ids, mb.position_ids, mb.targets[None],
                         cu_seqlens=mb.cu_seqlens, max_seqlen=mb.max_seqlen, temperature=cfg.temperature)
    return lp[0], ent[0]


@torch.no_grad()
def no_grad_logprobs(w: Wrapped, cfg: BackendConfig, micros: list[list[Micro]]) -> list[list[torch.Tensor]]:
    """Log-probs of every micro-batch under the current weights (old / reference).
    FSDP2 leaves a root unsharded after its forward (for the backward that would
    follow); none follows here, so the root is resharded: otherwise the reference
    model's embeddings and lm_head stay gathered for the whole update (issue 17, 2g)."""
    out = [[forward_logprobs(w, cfg, mb)[0] for mb in row] for row in micros]
    if w.strategy == "fsdp2":
        w.root.reshard()
    return out


def own_old_logprobs(cfg: BackendConfig, minibatches: int) -> bool:
    """Whether the trainer's old log-probs are the update's own forward, detached
    (TRL's shortcut): with one update per step the policy has not moved when the
    ratio is taken, so a separate no-grad pass would compute the same values. Not
    under LoRA dropout, whose masks the recomputed log-probs must not see."""
    one_update = minibatches * cfg.ppo_epochs == 1
    dropout = cfg.lora is not None and cfg.lora.dropout > 0
    return cfg.recompute_logprobs and one_update and not dropout


class RankTrainer:
    """Optimizer, schedule and the NaN streak of one rank; `train` runs one call."""

    def __init__(self, cfg: BackendConfig, w: Wrapped, device: torch.device, ref: Wrapped | None) -> None:
        self.cfg, self.w, self.device, self.ref = cfg, w, device, ref
        self.world = dist.get_world_size()
        params = [p for p in w.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            **adamw_kwargs(device),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.params = params
        self.step = 0          # optimizer steps taken
        self.nan_streak = 0    # consecutive skipped steps

    def train(self, local: LocalPack, hooks: RankHooks | None = None) -> list[dict[str, float]]:
        cfg, K, M = self.cfg, local.num_minibatches, local.num_micro
        micros = [[to_device(local.micro(k, m), self.device) for m in range(M)] for k in range(K)]
        if hooks is not None:  # benchmarks (backend/hooks.py): probe the ranks, bound the compute
            micros = hooks.before_update(micros)
        own = own_old_logprobs(cfg, K)
        old = no_grad_logprobs(self.w, cfg, micros) if cfg.recompute_logprobs and not own else None
        ref = no_grad_logprobs(self.ref, cfg, micros) if self.ref is not None else None
        if cfg.lora is not None and cfg.loss.kl_coef > 0:  # the base model: this one, adapters off
            with adapters_disabled(self.w.policy.hf):
                ref = no_grad_logprobs(self.w, cfg, micros)
        results = []
        for epoch in range(cfg.ppo_epochs):
            for k in range(K):
                t0 = time.perf_counter()
                out = self._optimizer_step(
                    micros[k], old[k] if old else None, ref[k] if ref else None, own
                )
                out.update(epoch=float(epoch), minibatch=float(k), step_time_s=time.perf_counter() - t0)
                results.append(out)
        return results

    def _optimizer_step(self, micros: list[Micro], old, ref, own: bool = False) -> dict[str, float]:
        """One optimizer step over a mini-batch's micro-batches. old: the recomputed
        old log-probs per micro-batch, or None: the sampler's, or with `own` the
        update's own log-probs, detached (the policy before its only update)."""
        cfg, dev = self.cfg, self.device
        acc = {k: torch.zeros((), device=dev) for k in ACCUMULATED}
        self.optimizer.zero_grad(set_to_none=True)
        for m, mb in enumerate(micros):
            with self._grad_sync(last=m == len(micros) - 1):
                with dropout_active(self.w.policy.hf, cfg.lora is not None and cfg.lora.dropout > 0):
                    lp, ent = forward_logprobs(self.w, cfg, mb)
                trainer_old = lp.detach() if own else (old[m] if old is not None else None)
                inp = LossInputs(
                    logprobs=lp,
                    old_logprobs=trainer_old if trainer_old is not None else mb.rollout_logprobs,
                    advantages=mb.advantages, loss_mask=mb.loss_mask, seq_weights=mb.seq_weights,
                    seq_index=mb.seq_index,
                    rollout_logprobs=mb.rollout_logprobs if trainer_old is not None else None,
                    ref_logprobs=ref[m] if ref is not None else None,
                    entropy=ent,
                )
                res = compute_loss(inp, cfg.loss)
                (res.loss * self.world).backward()
            accumulate(acc, res.metrics)
            acc["num_tokens"] += mb.num_tokens
            acc["num_seqs"] += mb.num_seqs
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        acc["grad_norm"] = norm.to(torch.float32)
        acc["lr"] = torch.full((), self.optimizer.param_groups[0]["lr"], device=dev)
        values = self._reduce_and_read(acc)
        return self._apply(values)

    def _reduce_and_read(self, acc: dict[str, torch.Tensor]) -> dict[str, float]:
        """One stacked vector (DEVICE_METRICS: sums, then maxima), one all_gather
        (then sum / max per key on the device, where NaN propagates the same way
        on every backend), one readback."""
        vec = torch.stack([acc[k] for k in DEVICE_METRICS])
        if self.world > 1:
            parts = [torch.empty_like(vec) for _ in range(self.world)]
            dist.all_gather(parts, vec)
            every = torch.stack(parts)  # [R, n]
            n = len(DEVICE_SUMS)
            vec = torch.cat([every[:, :n].sum(0), every[:, n:].amax(0)])
        host = vec.tolist()  # THE one device-to-host copy of the step
        return dict(zip(DEVICE_METRICS, host))

    def _apply(self, v: dict[str, float]) -> dict[str, float]:
        finite = math.isfinite(v["loss"]) and math.isfinite(v["grad_norm"])
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.nan_streak = 0
        else:  # skip: the gradients are dropped below, weights and schedule stay
            self.nan_streak += 1
        self.optimizer.zero_grad(set_to_none=True)
        out = finalize_step(v)
        out.update(nan_skipped=0.0 if finite else 1.0, step=float(self.step))
        if self.nan_streak >= self.cfg.max_nan_steps:
            raise NonFiniteStepsError(
                f"{self.nan_streak} optimizer steps in a row had a non-finite loss or grad norm "
                f"(last: loss={v['loss']}, grad_norm={v['grad_norm']}); stopping "
                f"(max_nan_steps={self.cfg.max_nan_steps}). Lower the learning rate or check the "
                "rewards/advantages for NaN."
            )
        return out

    def _grad_sync(self, last: bool):
        """Reduce gradients only after the last micro-batch of a mini-batch."""
        root = self.w.root
        if self.w.strategy == "fsdp2":
            root.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.world > 1 and not last:
            return root.no_sync()
        return contextlib.nullcontext()

    # -- resume ------------------------------------------------------------
    def state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "step": self.step, "nan_streak": self.nan_streak}

    def load(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.nan_streak = int(state["nan_streak"])
        # The next step's LR from this run's schedule: the optimizer state holds the
        # saved run's, whose horizon a longer --max-steps has moved.
        for group, base, f in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                  self.scheduler.lr_lambdas):
            group["lr"] = base * f(self.scheduler.last_epoch)


def accumulate(acc: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor]) -> None:
    """Fold one micro-batch's 0-dim device metrics into the step's accumulators,
    each by its reduction in the table (max, else a sum). No host sync."""
    for k, v in metrics.items():
        if METRICS[k].reduce == "max":
            acc[k] = torch.maximum(acc[k], v)
        else:
            acc[k] += v


def lr_lambda(cfg: BackendConfig):
    """Linear warmup over warmup_steps, then cosine from 1 to min_lr_ratio at total_steps."""
    warm, total, floor = cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if total is None or total <= warm:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
