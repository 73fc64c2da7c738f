"""GRPO and GSPO policy losses on packed per-token tensors.

All tensors are [L] over the positions of one micro-batch (see pack.py and split.py);
only positions with loss_mask contribute. The loss is a weighted SUM

    loss = sum_t w_t * l_t,   w_t = seq_weights[seq(t)] * loss_mask[t]

with weights normalised over the whole mini-batch (split.aggregation_weights),
so micro-batch losses add up to the mini-batch loss whatever the split. A
data-parallel backend whose gradient reduction *averages* over R ranks must
scale each rank's loss by R (see backend).

Policy-gradient term, with importance ratio rho = exp(logp - old_logp):

  GRPO (Shao et al. 2024), clipped per token:
      l_t = -min(rho_t A_t, clip(rho_t, 1-eps_low, 1+eps_high) A_t)
  GSPO (Zheng et al. 2025, arXiv:2507.18071), clipped per sequence on the
  length-normalised ratio s_i = exp(mean_{t in i}(logp_t - old_logp_t)):
      l_t = -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)  for t in i
  (with seq-mean-token-mean aggregation this is exactly the paper's
  sequence-level objective; its gradient flows through the mean of log-probs).

Clip-higher (DAPO, Yu et al. 2025) is eps_high > eps_low.
Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
RL"; verl's clip_ratio_c), off unless clip_ratio_c = C > 1 is set: for A_t < 0
      l_t = min(l_t, -C A_t)
so a token whose ratio ran far above 1 while its advantage is negative adds at
most C |A_t| and no gradient. It bounds GSPO's sequence ratio term the same way.
Optional terms:
  KL to a reference (Schulman's estimators): k1 = logp - ref,
      k3 = exp(ref - logp) - (ref - logp) - 1; added as kl_coef * kl_t.
  Entropy bonus: - entropy_coef * H_t.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy
optimization"; AReaL's objective for asynchronous RL, Fu et al. 2025) when
tis_cap is set and rollout_logprobs are given. Three policies score each token:

  pi_behav  the sampler that produced it (rollout_logprobs): under
            --off-policy-steps K it may be up to K weight versions old, and even
            at K = 0 its numerics differ from the trainer's
  pi_prox   the trainer's policy before this update (old_logprobs, recomputed
            by the trainer with --recompute-logprobs): the proximal policy the
            clip keeps pi_theta near
  pi_theta  the policy being optimised (logprobs, with grad)

  l_t = iw_t * pg_t(rho),  rho = pi_theta / pi_prox (GRPO per token, GSPO's
                           length-normalised sequence ratio), clipped and
                           dual-clipped exactly as above
  iw_t = min(pi_prox(t) / pi_behav(t), tis_cap), detached

so the clip measures how far this update moves from pi_prox, however stale the
sampler was, and iw_t corrects for sampling from pi_behav instead of pi_prox.
iw_t is per token for GSPO too (as AReaL and verl weight their GSPO loss):
with seq-mean-token-mean aggregation a sequence's term is scaled by the mean
of its tokens' weights (its gradient still flows through the mean of the
sequence's log-probs, so every token of it gets the same share). The weight
multiplies the policy-gradient term before aggregation, in every mode (no
self-normalisation: sum_t iw_t is not divided out). The capped weight is
truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"; verl's token-level TIS): a token
over the cap keeps weight tis_cap, where AReaL masks it out (weight 0). The
KL and entropy terms are not weighted (as verl's kl_loss and entropy terms).
Without rollout_logprobs (old log-probs are the sampler's) pi_prox = pi_behav
and iw_t = 1: plain PPO/GRPO/GSPO.

The weight's level and what happens over the cap (behaviour_weights), with
d_t = log pi_prox(t) - log pi_behav(t) on the loss tokens of sequence i:

  is_level token      w_t = exp(d_t)                       (as above)
  is_level sequence   w_i = exp(sum_{t in i} d_t)          verl's rollout_is=sequence:
                      the sequence's likelihood ratio (unbiased, high variance)
  is_level geometric  w_i = exp(mean_{t in i} d_t)         verl's rollout_rs=geometric,
                      GSPO's length normalisation applied to the behaviour ratio
  is_mode truncate    iw = min(w, tis_cap)                 (TIS, as above)
  is_mode mask        iw = w if is_mask_low <= w <= tis_cap else 0: the token, or
                      the whole sequence at the sequence levels, is dropped from
                      the loss (AReaL's behav_imp_weight_cap with is_mask_low = 0;
                      verl's rollout_rs band times its rollout_is weight)

A sequence-level log-weight is clamped too (verl's SAFETY_BOUND, the same 20):
a sum over thousands of tokens would overflow float32.

Every log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]
before exp (as verl: `negative_approx_kl` in compute_policy_loss, and the k3
`kl_penalty`): log(pi_theta / pi_prox) per token (GRPO) or per sequence after
the mean (GSPO), log(ref / pi_theta) of k3, and log(pi_prox / pi_behav) of the
weight. In fp32 exp overflows above ~88.7: one token that far off gave an inf
ratio, a NaN gradient and the whole step skipped. Clamped, the ratio is at
most e^20 ~ 4.9e8, the clip takes it as any ratio above 1 + eps, and
the clamped token gets no gradient through its ratio (the clamp's).

Behaviour/proximal mismatch metrics (metrics.py, "offpolicy/*"), computed on
the loss tokens whenever rollout_logprobs are given (0 otherwise):
  offpolicy_kl     k3 estimate of KL(pi_behav || pi_prox) per token,
                   r - 1 - log r with r = pi_prox / pi_behav (the tokens are
                   samples of pi_behav, so its mean is the KL; >= 0 per token)
  tis_capped_frac  share of tokens whose weight pi_prox / pi_behav exceeded
                   tis_cap and was capped (0 when tis_cap is off or is_mode mask)
  is_masked_frac   share of tokens whose weight fell outside the mask band and
                   was dropped (0 unless is_mode mask)
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch

from areno.choices import Algo, ISLevel, ISMode, KLType

ALGOS: tuple[str, ...] = typing.get_args(Algo)
KL_TYPES: tuple[str, ...] = typing.get_args(KLType)
IS_LEVELS: tuple[str, ...] = typing.get_args(ISLevel)
IS_MODES: tuple[str, ...] = typing.get_args(ISMode)
# |log-ratio| bound before every exp (the module docstring): verl's 20.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossConfig:
    algo: Algo = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_type: KLType = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None  # cap C of iw_t = min(pi_prox / pi_behav, C) (None = no weight)
    clip_ratio_c: float | None = None  # dual-clip constant C > 1 (None = off)
    is_level: ISLevel = "token"   # level of the behaviour weight (token, sequence, geometric)
    is_mode: ISMode = "truncate"  # over the cap: truncate to it, or mask (drop) the token/sequence
    is_mask_low: float = 0.0      # mask mode: weights below this are dropped too

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"algo: expected one of {ALGOS}, got {self.algo!r}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type: expected one of {KL_TYPES}, got {self.kl_type!r}")
        if not (0 <= self.clip_eps_low < 1) or self.clip_eps_high < 0:
            raise ValueError("clip eps: need 0 <= eps_low < 1 and eps_high >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be > 0")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.is_level not in IS_LEVELS or self.is_mode not in IS_MODES:
            raise ValueError(f"is_level/is_mode: expected {IS_LEVELS} / {IS_MODES}, got "
                             f"{self.is_level!r} / {self.is_mode!r}")
        if self.is_mask_low < 0 or (self.tis_cap is not None and self.is_mask_low >= self.tis_cap):
            raise ValueError("is_mask_low: need 0 <= is_mask_low < tis_cap")


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch, on the training device. [L] unless noted."""

    logprobs: torch.Tensor          # float32, pi_theta: trainer log-prob of each target (with grad)
    old_logprobs: torch.Tensor      # float32, pi_prox: recomputed by the trainer, else the sampler's
    advantages: torch.Tensor        # float32
    loss_mask: torch.Tensor         # bool
    seq_weights: torch.Tensor       # [S] float32 aggregation weight per loss token
    seq_index: torch.Tensor         # int64 (or int32), local sequence 0..S-1
    rollout_logprobs: torch.Tensor | None = None  # pi_behav: the sampler's, when old_* are recomputed
    ref_logprobs: torch.Tensor | None = None      # reference model's, for KL
    entropy: torch.Tensor | None = None           # per-token entropy (with grad if bonus on)


@dataclass(frozen=True)
class LossOutputs:
    loss: torch.Tensor                  # 0-dim, weighted sum (add across micro-batches)
    # 0-dim device tensors named in metrics.LOSS_METRICS: sums over the micro-batch's
    # loss tokens, or its maximum where the table's reduce is "max".
    metrics: dict[str, torch.Tensor]


def _segment_sum(x: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq_index, x)


def _bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    """log_ratio clamped to +-LOG_RATIO_CLAMP: exp of it stays finite in fp32."""
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def compute_loss(inp: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Policy loss of one micro-batch and its metric sums (no host sync)."""
    mask = inp.loss_mask
    maskf = mask.to(inp.logprobs.dtype)
    seq_index = inp.seq_index.long()
    num_seqs = inp.seq_weights.numel()
    w = inp.seq_weights[seq_index] * maskf
    adv = inp.advantages
    # Off-mask positions may hold anything (padding, prompt); zero their log-ratio
    # so exp() cannot overflow into inf * 0 = nan.
    log_ratio = torch.where(mask, inp.logprobs - inp.old_logprobs, torch.zeros_like(inp.logprobs))

    if cfg.algo == "grpo":
        log_rho = log_ratio
    else:
        n_tok = _segment_sum(maskf, seq_index, num_seqs).clamp_min(1.0)
        seq_log_ratio = _segment_sum(log_ratio, seq_index, num_seqs) / n_tok
        log_rho = seq_log_ratio[seq_index]
    rho = torch.exp(_bounded(log_rho))
    unclipped = -adv * rho
    clipped = -adv * torch.clamp(rho, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(unclipped, clipped)
    if cfg.clip_ratio_c is not None:  # dual-clip: cap the loss of negative-advantage tokens
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)

    # Decoupled PPO: log(pi_prox / pi_behav) of each loss token (0 off the mask, and
    # everywhere when old log-probs are the sampler's own).
    behav_log_w = behav_w = tis = over = None
    if inp.rollout_logprobs is not None:
        behav_log_w = torch.where(mask, inp.old_logprobs - inp.rollout_logprobs,
                                  torch.zeros_like(log_ratio)).detach()
        behav_log_w = _bounded(behav_log_w)
        behav_w = torch.exp(behav_log_w)  # pi_prox / pi_behav per token, uncapped
        if cfg.tis_cap is not None:
            tis, over = behaviour_weights(behav_log_w, mask, seq_index, num_seqs, cfg)
            pg = pg * tis

    per_tok = pg
    kl = None
    if cfg.kl_coef and inp.ref_logprobs is not None:
        d = torch.where(mask, inp.ref_logprobs - inp.logprobs, torch.zeros_like(log_ratio))
        if cfg.kl_type == "k1":
            kl = -d
        else:
            d = _bounded(d)
            kl = torch.exp(d) - d - 1.0
        per_tok = per_tok + cfg.kl_coef * kl
    if cfg.entropy_coef and inp.entropy is not None:
        per_tok = per_tok - cfg.entropy_coef * inp.entropy
    loss = (per_tok * w).sum()

    metrics = _metric_sums(inp, cfg, loss, rho, (clipped > unclipped) & mask, kl, tis, over,
                           behav_w, behav_log_w)
    return LossOutputs(loss=loss, metrics=metrics)


@torch.no_grad()
def _metric_sums(inp: LossInputs, cfg: LossConfig, loss: torch.Tensor, rho: torch.Tensor,
                 clip_hit: torch.Tensor, kl: torch.Tensor | None, tis: torch.Tensor | None,
                 over: torch.Tensor | None, behav_w: torch.Tensor | None,
                 behav_log_w: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """compute_loss's metrics (LossOutputs.metrics): 0-dim sums over the loss tokens.
    rho: [L] ratio; clip_hit: [L] bool, loss tokens where the clipped term won; kl,
    tis, behav_w, behav_log_w: [L] float or None (off); over: [L] bool or None."""
    mask = inp.loss_mask
    maskf = mask.to(inp.logprobs.dtype)
    rho_m = rho * maskf
    rollout = inp.rollout_logprobs if inp.rollout_logprobs is not None else inp.old_logprobs
    return {
        "loss": loss.detach(),
        "loss_tokens": maskf.sum(),
        "clip_frac": clip_hit.to(maskf.dtype).sum(),
        "ratio_mean": rho_m.sum(),
        "ratio_sq": (rho_m * rho).sum(),
        "ratio_max": torch.where(mask, rho, torch.zeros_like(rho)).max()
        if rho.numel()
        else rho.new_zeros(()),
        "logprob_diff": ((inp.logprobs - rollout).abs() * maskf).sum(),
        "kl": (kl * maskf).sum() if kl is not None else maskf.new_zeros(()),
        "entropy": (inp.entropy * maskf).sum() if inp.entropy is not None else maskf.new_zeros(()),
        "tis_weight": (tis * maskf).sum() if tis is not None else maskf.sum(),
        # k3 = r - 1 - log r, r = pi_prox / pi_behav: KL(pi_behav || pi_prox) per token
        "offpolicy_kl": ((behav_w - 1.0 - behav_log_w) * maskf).sum()
        if behav_w is not None and behav_log_w is not None else maskf.new_zeros(()),
        "tis_capped_frac": over.to(maskf.dtype).sum()
        if over is not None and cfg.is_mode == "truncate" else maskf.new_zeros(()),
        "is_masked_frac": over.to(maskf.dtype).sum()
        if over is not None and cfg.is_mode == "mask" else maskf.new_zeros(()),
    }


def behaviour_weights(log_w: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor,
                      num_seqs: int, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's weight iw of pi_prox / pi_behav at cfg.is_level, truncated or
    masked by cfg.is_mode (module docstring). log_w: [L] float, log pi_prox - log
    pi_behav, 0 off the mask (detached). -> ([L] iw, detached; [L] bool, the loss
    tokens whose weight was over the cap (truncate) or outside the band (mask))."""
    if cfg.is_level == "token":
        lw = log_w
    else:  # one weight per sequence, broadcast to its tokens
        seq_lw = _segment_sum(log_w, seq_index, num_seqs)
        if cfg.is_level == "geometric":
            seq_lw = seq_lw / _segment_sum(mask.to(log_w.dtype), seq_index, num_seqs).clamp_min(1.0)
        lw = _bounded(seq_lw)[seq_index]
    w = torch.exp(lw)
    if cfg.is_mode == "truncate":
        return w.clamp(max=cfg.tis_cap), (w > cfg.tis_cap) & mask
    out = (w > cfg.tis_cap) | (w < cfg.is_mask_low)
    return torch.where(out, torch.zeros_like(w), w), out & mask
