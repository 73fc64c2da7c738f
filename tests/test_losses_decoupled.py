"""Decoupled PPO (losses.py, issue 20): the clipped ratio against the trainer's
proximal log-probs, times min(pi_prox / pi_behav, cap) per token, and the
behaviour/proximal mismatch metrics, against a plain-Python per-sequence
reference of the loss and of its gradient (written out by hand, no autograd)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import float64_default, random_batch  # noqa: F401 (float64_default: autouse, float64 references)

from areno.losses import LossConfig, LossInputs, compute_loss
from areno.metrics import METRICS, TRAIN_METRICS, finalize_step, train_metrics
from areno.split import build_split_pack

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_LEN = 9


# -- the reference: floats and math only ----------------------------------------
def reference(seqs: list[dict], cfg: LossConfig, mode: str) -> tuple[float, list[list[float]], dict]:
    """seqs: per sequence, lists over its loss tokens of logp (pi_theta), prox
    (pi_prox), behav (pi_behav), ref, ent, and its advantage adv. -> (loss,
    d loss / d logp per sequence and token, metric sums over the tokens)."""
    n_tok = sum(len(s["logp"]) for s in seqs)
    n_seq = sum(1 for s in seqs if s["logp"])
    eps_lo, eps_hi, C, cap = cfg.clip_eps_low, cfg.clip_eps_high, cfg.clip_ratio_c, cfg.tis_cap
    loss, grads = 0.0, []
    m = dict(offpolicy_kl=0.0, tis_capped_frac=0.0, tis_weight=0.0, clip_frac=0.0)

    def pg_and_slope(rho: float, a: float) -> tuple[float, float]:
        """The clipped (and dual-clipped) term at ratio rho and d term / d rho."""
        unclipped, clipped = -a * rho, -a * min(max(rho, 1 - eps_lo), 1 + eps_hi)
        val, slope = (unclipped, -a) if unclipped >= clipped else (clipped, 0.0)
        if C is not None and a < 0 and val > -a * C:
            val, slope = -a * C, 0.0
        return val, slope

    for s in seqs:
        n, a = len(s["logp"]), s["adv"]
        if n == 0:
            grads.append([])
            continue
        agg = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (n * n_seq),
               "seq-mean-token-sum-norm": 1 / (NORM_LEN * n_seq)}[mode]
        iw = []
        for t in range(n):
            r = math.exp(s["prox"][t] - s["behav"][t])  # pi_prox / pi_behav
            iw.append(min(r, cap) if cap is not None else 1.0)
            m["offpolicy_kl"] += r - 1 - math.log(r)
            m["tis_capped_frac"] += float(cap is not None and r > cap)
            m["tis_weight"] += iw[-1]
        g = [0.0] * n
        if cfg.algo == "gspo":
            s_i = math.exp(sum(s["logp"][t] - s["prox"][t] for t in range(n)) / n)
            val, slope = pg_and_slope(s_i, a)
            for t in range(n):
                loss += agg * iw[t] * val
                m["clip_frac"] += float(-a * min(max(s_i, 1 - eps_lo), 1 + eps_hi) > -a * s_i)
            # d s_i / d logp_u = s_i / n for every token u of the sequence
            for u in range(n):
                g[u] += sum(agg * iw[t] for t in range(n)) * slope * s_i / n
        else:
            for t in range(n):
                rho = math.exp(s["logp"][t] - s["prox"][t])
                val, slope = pg_and_slope(rho, a)
                loss += agg * iw[t] * val
                g[t] += agg * iw[t] * slope * rho
                m["clip_frac"] += float(-a * min(max(rho, 1 - eps_lo), 1 + eps_hi) > -a * rho)
        for t in range(n):  # KL to the reference and entropy: never importance-weighted
            if cfg.kl_coef:
                d = s["ref"][t] - s["logp"][t]
                kl, dkl = (-d, 1.0) if cfg.kl_type == "k1" else (math.exp(d) - d - 1, 1 - math.exp(d))
                loss += agg * cfg.kl_coef * kl
                g[t] += agg * cfg.kl_coef * dkl
            if cfg.entropy_coef:
                loss -= agg * cfg.entropy_coef * s["ent"][t]
        grads.append(g)
    return loss, grads, m


def make_case(seed: int, mode: str, behav_sd: float):
    """A random packed micro-batch: logp = prox + noise (ratios off 1, some clip),
    behav = prox + noise of sd behav_sd (weights off 1, some over the cap)."""
    b = random_batch(seed=seed, num_prompts=6, max_response=7)
    rng = np.random.default_rng(seed)
    adv = rng.standard_normal(b.num_responses).astype(np.float32)
    pack = build_split_pack(b, adv, world_size=1, max_tokens=10_000, num_minibatches=1,
                            loss_agg=mode, norm_len=NORM_LEN).pack
    L = pack.num_tokens
    prox = pack.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.05, L))  # recomputed
    behav = pack.old_logprobs.double()                                            # the sampler's
    behav = behav + torch.from_numpy(rng.normal(0, behav_sd, L))
    logp = prox + torch.from_numpy(rng.normal(0, 0.3, L))
    ref = prox + torch.from_numpy(rng.normal(0, 0.2, L))
    ent = torch.from_numpy(rng.random(L))
    return pack, logp, prox, behav, ref, ent


def per_sequence(pack, logp, prox, behav, ref, ent) -> list[dict]:
    cu, seqs = pack.cu_seqlens.tolist(), []
    for i in range(pack.num_seqs):
        sl = slice(cu[i], cu[i + 1])
        mk = pack.loss_mask[sl]
        adv = pack.advantages[sl][mk]
        seqs.append(dict(logp=logp[sl][mk].tolist(), prox=prox[sl][mk].tolist(),
                         behav=behav[sl][mk].tolist(), ref=ref[sl][mk].tolist(),
                         ent=ent[sl][mk].tolist(), adv=float(adv[0]) if adv.numel() else 0.0))
    return seqs


CONFIGS = [
    LossConfig(algo="grpo", tis_cap=1.1),
    LossConfig(algo="grpo", tis_cap=2.0, clip_eps_low=0.1, clip_eps_high=0.28),
    LossConfig(algo="grpo", tis_cap=1.2, clip_ratio_c=1.1, kl_coef=0.05, kl_type="k3",
               entropy_coef=0.01),
    LossConfig(algo="grpo", tis_cap=1.5, kl_coef=0.1, kl_type="k1"),
    LossConfig(algo="gspo", tis_cap=1.1, clip_eps_low=3e-2, clip_eps_high=4e-2),
    LossConfig(algo="gspo", tis_cap=2.0, clip_eps_low=0.05, clip_eps_high=0.05, clip_ratio_c=1.02,
               kl_coef=0.05, entropy_coef=0.02),
    LossConfig(algo="gspo", tis_cap=1.3),  # gspo's own default eps are 3e-4 / 4e-4: all clip
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.algo}-cap{c.tis_cap}-c{c.clip_ratio_c}"
                         f"-kl{c.kl_coef}{c.kl_type}-ent{c.entropy_coef}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_loss_grad_and_metrics_match_the_per_sequence_reference(cfg, mode, seed):
    pack, logp, prox, behav, ref, ent = make_case(seed, mode, behav_sd=0.6)
    lp = logp.clone().requires_grad_(True)
    out = compute_loss(LossInputs(
        logprobs=lp, old_logprobs=prox, advantages=pack.advantages.double(), loss_mask=pack.loss_mask,
        seq_weights=pack.seq_weights.double(), seq_index=pack.local_seq_index(),
        rollout_logprobs=behav, ref_logprobs=ref, entropy=ent), cfg)
    out.loss.backward()

    seqs = per_sequence(pack, logp, prox, behav, ref, ent)
    want_loss, want_grads, want_m = reference(seqs, cfg, mode)
    # seq_weights are float32 in the pack, hence 1e-6 rather than double precision
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-6, abs=1e-9)
    got = [g.tolist() for g in _per_sequence_grads(pack, lp.grad)]
    for g, w in zip(got, want_grads):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-9)
    assert torch.all(lp.grad[~pack.loss_mask] == 0)
    # some weights were capped, some not: both paths of min(w, cap) are exercised
    n_tok = sum(len(s["logp"]) for s in seqs)
    assert 0 < want_m["tis_capped_frac"] < n_tok
    for k, v in want_m.items():
        assert out.metrics[k].item() == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # token means after the step's readback, as metrics.jsonl reports them
    host = finalize_step({k: float(v) for k, v in out.metrics.items()})
    assert host["offpolicy_kl"] == pytest.approx(want_m["offpolicy_kl"] / n_tok, rel=1e-9)
    assert host["tis_capped_frac"] == pytest.approx(want_m["tis_capped_frac"] / n_tok, rel=1e-9)
    assert host["offpolicy_kl"] > 0


def _per_sequence_grads(pack, grad):
    cu = pack.cu_seqlens.tolist()
    return [grad[cu[i]:cu[i + 1]][pack.loss_mask[cu[i]:cu[i + 1]]] for i in range(pack.num_seqs)]


def _one_seq(logp, prox, behav, adv, **kw):
    n = len(logp)
    return LossInputs(
        logprobs=torch.tensor(logp, requires_grad=True), old_logprobs=torch.tensor(prox),
        advantages=torch.full((n,), adv), loss_mask=torch.ones(n, dtype=torch.bool),
        seq_weights=torch.tensor([1.0 / n]), seq_index=torch.zeros(n, dtype=torch.long),
        rollout_logprobs=torch.tensor(behav), **kw)


def test_a_capped_token_keeps_weight_cap_and_an_uncapped_one_its_ratio():
    # pi_prox / pi_behav = 3 (capped at 2) and 0.5; pi_theta = pi_prox: ratio 1, no clip
    prox = [-1.0, -2.0]
    behav = [-1.0 - math.log(3.0), -2.0 + math.log(2.0)]
    inp = _one_seq(prox, prox, behav, 1.0)
    out = compute_loss(inp, LossConfig(tis_cap=2.0))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor([-2.0 / 2, -0.5 / 2]))
    assert out.metrics["tis_capped_frac"].item() == 1.0
    assert out.metrics["tis_weight"].item() == pytest.approx(2.5)
    assert out.metrics["offpolicy_kl"].item() == pytest.approx(
        (3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5)))


def test_unclipped_and_uncapped_it_is_importance_sampling_from_the_sampler():
    """rho * w = (pi_theta / pi_prox) (pi_prox / pi_behav) = pi_theta / pi_behav:
    with the clip and the cap out of reach the loss is -A pi_theta / pi_behav,
    whatever pi_prox is."""
    rng = np.random.default_rng(3)
    behav = rng.normal(-2, 0.5, 6)
    prox = behav + rng.normal(0, 0.3, 6)
    logp = prox + rng.normal(0, 0.1, 6)
    cfg = LossConfig(clip_eps_low=0.999, clip_eps_high=1e9, tis_cap=1e9)
    out = compute_loss(_one_seq(logp.tolist(), prox.tolist(), behav.tolist(), 1.5), cfg)
    assert out.loss.item() == pytest.approx(-1.5 * np.exp(logp - behav).mean(), rel=1e-12)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_behaviour_equal_to_proximal_is_the_plain_loss_with_zero_mismatch(algo):
    pack, logp, prox, _, ref, ent = make_case(5, "seq-mean-token-mean", behav_sd=0.0)
    common = dict(logprobs=logp, old_logprobs=prox, advantages=pack.advantages.double(),
                  loss_mask=pack.loss_mask, seq_weights=pack.seq_weights.double(),
                  seq_index=pack.local_seq_index(), ref_logprobs=ref, entropy=ent)
    cfg = LossConfig(algo=algo, tis_cap=2.0, kl_coef=0.1)
    same = compute_loss(LossInputs(**common, rollout_logprobs=prox), cfg)
    plain = compute_loss(LossInputs(**common), cfg)
    assert same.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    assert same.metrics["offpolicy_kl"].item() == 0 and same.metrics["tis_capped_frac"].item() == 0
    # no sampler log-probs (old ones are the sampler's): both metrics 0, weight 1
    assert plain.metrics["offpolicy_kl"].item() == 0 and plain.metrics["tis_capped_frac"].item() == 0
    assert plain.metrics["tis_weight"].item() == plain.metrics["loss_tokens"].item()


def test_recompute_without_a_cap_reports_the_mismatch_but_weights_nothing():
    prox, behav = [-1.0, -2.0], [-1.5, -1.8]
    with_rollout = compute_loss(_one_seq(prox, prox, behav, 1.0), LossConfig())
    assert with_rollout.loss.item() == pytest.approx(-1.0)
    assert with_rollout.metrics["offpolicy_kl"].item() > 0
    assert with_rollout.metrics["tis_capped_frac"].item() == 0


def test_the_mismatch_metrics_are_logged_as_offpolicy_keys():
    assert METRICS["offpolicy_kl"].key == "offpolicy/kl"
    assert METRICS["tis_capped_frac"].key == "offpolicy/tis_capped_frac"
    assert METRICS["tis_weight"].key == "train/tis_weight"
    keys = train_metrics([])
    assert "offpolicy/kl" in keys and "offpolicy/tis_capped_frac" in keys
    assert {"offpolicy_kl", "tis_capped_frac"} <= set(TRAIN_METRICS)
    assert METRICS["offpolicy_kl"].reduce == METRICS["tis_capped_frac"].reduce == "token_mean"
