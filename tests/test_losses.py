import math

import numpy as np
import pytest
import torch

from areno.losses import LossConfig, LossInputs, compute_loss
from areno.pack import build_padded_pack, build_train_pack
from areno.split import build_split_pack
from helpers import float64_default, random_batch  # noqa: F401 (float64_default: autouse, float64 references)


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORM_LEN = 9


# -- a per-sample, loop-based reference --------------------------------------
def reference_loss(seqs, cfg: LossConfig, mode: str):
    """seqs: list of dicts with per-token python lists logp/old/adv (+ref, rollout).
    Returns a scalar torch loss built token by token."""
    n_tok = sum(len(s["logp"]) for s in seqs)
    n_seq = sum(1 for s in seqs if s["logp"])
    total = torch.zeros(())
    for s in seqs:
        n = len(s["logp"])
        if n == 0:
            continue
        if mode == "token-mean":
            w = 1.0 / n_tok
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (n * n_seq)
        else:
            w = 1.0 / (NORM_LEN * n_seq)
        if cfg.algo == "gspo":
            seq_lr = sum(s["logp"][t] - s["old"][t] for t in range(n)) / n
        for t in range(n):
            lr = s["logp"][t] - s["old"][t] if cfg.algo == "grpo" else seq_lr
            rho = torch.exp(lr)
            a = s["adv"]
            pg = torch.maximum(-a * rho, -a * torch.clamp(rho, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
            if cfg.clip_ratio_c is not None and a < 0:
                pg = torch.minimum(pg, torch.tensor(-a * cfg.clip_ratio_c))
            if cfg.tis_cap is not None:
                pg = pg * min(math.exp(float(s["old"][t]) - s["rollout"][t]), cfg.tis_cap)
            term = pg
            if cfg.kl_coef:
                d = s["ref"][t] - s["logp"][t]
                kl = -d if cfg.kl_type == "k1" else torch.exp(d) - d - 1
                term = term + cfg.kl_coef * kl
            if cfg.entropy_coef:
                term = term - cfg.entropy_coef * s["ent"][t]
            total = total + w * term
    return total


def make_case(seed: int, world_size=1, max_tokens=10_000, num_minibatches=1, mode="token-mean"):
    b = random_batch(seed=seed, num_prompts=6, max_response=7)
    rng = np.random.default_rng(seed)
    adv = rng.standard_normal(b.num_responses).astype(np.float32)
    sp = build_split_pack(b, adv, world_size=world_size, max_tokens=max_tokens,
                          num_minibatches=num_minibatches, loss_agg=mode, norm_len=NORM_LEN)
    L = sp.pack.num_tokens
    # "new" log-probs: old plus noise, so ratios differ from 1 and some clip
    new_lp = sp.pack.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.3, L))
    ref_lp = sp.pack.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.2, L))
    rollout_lp = sp.pack.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.1, L))
    ent = torch.from_numpy(rng.random(L))
    return b, sp, new_lp, ref_lp, rollout_lp, ent


def inputs_for(pack, logp, ref, rollout, ent, seq_index=None):
    m = pack.loss_mask
    return LossInputs(
        logprobs=logp,
        old_logprobs=pack.old_logprobs.double(),
        advantages=pack.advantages.double(),
        loss_mask=m,
        seq_weights=pack.seq_weights.double(),
        seq_index=pack.local_seq_index() if seq_index is None else seq_index,
        rollout_logprobs=rollout,
        ref_logprobs=ref,
        entropy=ent,
    )


def to_seqs(pack, logp, ref, rollout, ent):
    cu = pack.cu_seqlens.tolist()
    seqs = []
    for s in range(pack.num_seqs):
        sl = slice(cu[s], cu[s + 1])
        m = pack.loss_mask[sl]
        adv = pack.advantages[sl][m]
        seqs.append(dict(
            logp=list(logp[sl][m].unbind(0)),
            old=pack.old_logprobs[sl][m].double().tolist(),
            adv=float(adv[0]) if adv.numel() else 0.0,
            ref=list(ref[sl][m].unbind(0)),
            rollout=rollout[sl][m].tolist(),
            ent=ent[sl][m].tolist(),
        ))
    return seqs


CONFIGS = [
    LossConfig(algo="grpo"),
    LossConfig(algo="grpo", clip_eps_low=0.1, clip_eps_high=0.28),
    LossConfig(algo="gspo", clip_eps_low=3e-2, clip_eps_high=4e-2),
    LossConfig(algo="grpo", kl_coef=0.1, kl_type="k1", entropy_coef=0.01),
    LossConfig(algo="grpo", kl_coef=0.05, kl_type="k3", tis_cap=1.05),
    LossConfig(algo="gspo", kl_coef=0.05, kl_type="k3", tis_cap=2.0, entropy_coef=0.02),
    LossConfig(algo="grpo", clip_ratio_c=1.1, kl_coef=0.05),
    LossConfig(algo="gspo", clip_eps_low=0.05, clip_eps_high=0.05, clip_ratio_c=1.02),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.algo}-kl{c.kl_coef}{c.kl_type}-tis{c.tis_cap}"
                         f"-c{c.clip_ratio_c}")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_grad_match_loop_reference(cfg, mode, seed):
    _, sp, new_lp, ref, rollout, ent = make_case(seed, mode=mode)
    pack = sp.pack
    logp = new_lp.clone().requires_grad_(True)
    out = compute_loss(inputs_for(pack, logp, ref, rollout, ent), cfg)
    out.loss.backward()

    logp_ref = new_lp.clone().requires_grad_(True)
    want = reference_loss(to_seqs(pack, logp_ref, ref, rollout, ent), cfg, mode)
    want.backward()
    # seq_weights are float32 in the pack, hence 1e-6 rather than double precision
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=0, atol=1e-6)
    # gradient never flows to positions off the loss mask
    assert torch.all(logp.grad[~pack.loss_mask] == 0)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_does_not_depend_on_the_split(algo, mode):
    cfg = LossConfig(algo=algo, kl_coef=0.1)
    results = []
    for world_size, max_tokens in [(1, 10_000), (1, 12), (2, 15), (3, 8)]:
        b, sp, _, _, _, _ = make_case(3, world_size=world_size, max_tokens=max_tokens, mode=mode)
        # same per-response noise regardless of layout: key it on sample_index
        rng = np.random.default_rng(7)
        noise = torch.from_numpy(rng.normal(0, 0.3, b.num_response_tokens))
        total = torch.zeros(())
        grads = torch.zeros(b.num_response_tokens)
        for r in range(world_size):
            for m in range(sp.num_micro):
                mb = sp.micro(r, 0, m)
                if mb.num_tokens == 0:
                    continue
                resp_pos = _response_token_positions(b, mb)
                logp = (mb.old_logprobs.double().clone())
                logp[mb.loss_mask] += noise[resp_pos]
                logp.requires_grad_(True)
                ref = mb.old_logprobs.double()
                out = compute_loss(inputs_for(mb, logp, ref, None, None), cfg)
                out.loss.backward()
                total += out.loss.detach()
                grads[resp_pos] += logp.grad[mb.loss_mask]
        results.append((total, grads))
    for total, grads in results[1:]:
        torch.testing.assert_close(total, results[0][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads, results[0][1], rtol=1e-9, atol=1e-12)


def _response_token_positions(batch, mb):
    """Index into batch.response_* of each loss token of micro-batch mb."""
    idx = []
    for i in mb.sample_index.tolist():
        idx += list(range(batch.response_offsets[i], batch.response_offsets[i + 1]))
    return torch.tensor(idx, dtype=torch.long)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_packed_and_padded_give_same_loss_and_grad(algo):
    b = random_batch(seed=4)
    adv = np.random.default_rng(4).standard_normal(b.num_responses).astype(np.float32)
    sp = build_split_pack(b, adv, world_size=1, max_tokens=10_000, loss_agg="seq-mean-token-mean")
    pack = sp.pack
    noise = torch.from_numpy(np.random.default_rng(5).normal(0, 0.3, pack.num_tokens))
    cfg = LossConfig(algo=algo)

    lp_packed = (pack.old_logprobs.double() + noise).requires_grad_(True)
    out_p = compute_loss(inputs_for(pack, lp_packed, None, None, None), cfg)
    out_p.loss.backward()

    pad = build_padded_pack(b, adv, order=pack.sample_index.numpy())
    S, Lmax = pad.input_ids.shape
    noise_pad = torch.zeros(S, Lmax, dtype=torch.float64)
    noise_pad[pad.attention_mask] = noise
    lp_pad = (pad.old_logprobs.double() + noise_pad).requires_grad_(True)
    seq_idx = torch.arange(S).unsqueeze(1).expand(S, Lmax).reshape(-1)
    out_d = compute_loss(
        LossInputs(
            logprobs=lp_pad.reshape(-1),
            old_logprobs=pad.old_logprobs.double().reshape(-1),
            advantages=pad.advantages.double().reshape(-1),
            loss_mask=pad.loss_mask.reshape(-1),
            seq_weights=pack.seq_weights.double(),
            seq_index=seq_idx,
        ),
        cfg,
    )
    out_d.loss.backward()
    torch.testing.assert_close(out_d.loss, out_p.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp_pad.grad[pad.attention_mask], lp_packed.grad, rtol=1e-10, atol=1e-14)


def _single_seq(logp, old, adv):
    n = len(logp)
    return LossInputs(
        logprobs=torch.tensor(logp, requires_grad=True),
        old_logprobs=torch.tensor(old),
        advantages=torch.full((n,), adv),
        loss_mask=torch.ones(n, dtype=torch.bool),
        seq_weights=torch.tensor([1.0 / n]),
        seq_index=torch.zeros(n, dtype=torch.long),
    )


def test_ratio_is_real_and_clip_engages_exactly_where_it_should():
    # ratios exp(d): 1.1 (inside), 1.5 (above 1+eps), 0.5 (below 1-eps)
    d = [math.log(1.1), math.log(1.5), math.log(0.5)]
    old = [-1.0, -2.0, -0.5]
    logp = [o + x for o, x in zip(old, d)]
    cfg = LossConfig(algo="grpo", clip_eps_low=0.2, clip_eps_high=0.2)
    # positive advantage: clipping bites only above 1+eps
    inp = _single_seq(logp, old, 1.0)
    out = compute_loss(inp, cfg)
    out.loss.backward()
    g = inp.logprobs.grad
    assert out.metrics["ratio_mean"].item() == pytest.approx((1.1 + 1.5 + 0.5), rel=1e-9)
    assert out.metrics["clip_frac"].item() == 1.0
    assert g[1] == 0 and g[0] == pytest.approx(-1.1 / 3) and g[2] == pytest.approx(-0.5 / 3)
    # negative advantage: clipping bites only below 1-eps
    inp = _single_seq(logp, old, -1.0)
    out = compute_loss(inp, cfg)
    out.loss.backward()
    g = inp.logprobs.grad
    assert out.metrics["clip_frac"].item() == 1.0
    assert g[2] == 0 and g[0] == pytest.approx(1.1 / 3) and g[1] == pytest.approx(1.5 / 3)
    # clip-higher: eps_high 0.6 lets the 1.5 ratio through
    inp = _single_seq(logp, old, 1.0)
    out = compute_loss(inp, LossConfig(algo="grpo", clip_eps_low=0.2, clip_eps_high=0.6))
    assert out.metrics["clip_frac"].item() == 0.0


def test_gspo_clips_the_sequence_ratio():
    # token ratios 1.5 and 1/1.5 -> sequence ratio exactly 1: nothing clips in GSPO,
    # while GRPO clips the first token
    d = [math.log(1.5), -math.log(1.5)]
    inp = _single_seq([-1 + d[0], -1 + d[1]], [-1.0, -1.0], 1.0)
    assert compute_loss(inp, LossConfig(algo="gspo")).metrics["clip_frac"].item() == 0.0
    assert compute_loss(inp, LossConfig(algo="grpo")).metrics["clip_frac"].item() == 1.0
    # both tokens up by 1.3 -> sequence ratio 1.3 > 1.2: the whole sequence clips
    inp = _single_seq([-1 + math.log(1.3)] * 2, [-1.0, -1.0], 1.0)
    out = compute_loss(inp, LossConfig(algo="gspo"))
    out.loss.backward()
    assert out.metrics["clip_frac"].item() == 2.0
    assert torch.all(inp.logprobs.grad == 0)


def test_dual_clip_caps_the_loss_of_negative_advantage_tokens_at_c_times_minus_a():
    # ratios 0.5, 1.1, 2.5, 4.0 with A = -2 and C = 3: the standard clipped loss is
    # -A*max(rho, 0.8) = 1.6, 2.2, 5.0, 8.0; dual-clip caps it at -C*A = 6.
    rho = [0.5, 1.1, 2.5, 4.0]
    old = [-1.0, -2.0, -3.0, -4.0]
    logp = [o + math.log(r) for o, r in zip(old, rho)]
    inp = _single_seq(logp, old, -2.0)
    out = compute_loss(inp, LossConfig(algo="grpo", clip_ratio_c=3.0))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((1.6 + 2.2 + 5.0 + 6.0) / 4)
    # d/dlogp of -A*rho is -A*rho; clipped (0.5) and capped (4.0) tokens get none
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor([0.0, 2 * 1.1 / 4, 2 * 2.5 / 4, 0.0]))
    # without it the 4.0 token's loss is 8 and it still pushes down
    inp = _single_seq(logp, old, -2.0)
    out = compute_loss(inp, LossConfig(algo="grpo"))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((1.6 + 2.2 + 5.0 + 8.0) / 4)
    assert inp.logprobs.grad[3] == pytest.approx(2 * 4.0 / 4)
    # positive advantages are untouched: A = +2, ratio 4 -> clipped at 1.2, loss -2.4
    inp = _single_seq(logp[3:], old[3:], 2.0)
    assert compute_loss(inp, LossConfig(clip_ratio_c=3.0)).loss.item() == pytest.approx(-2.4)


def test_equal_logprobs_give_unit_ratio_and_policy_gradient():
    inp = _single_seq([-1.0, -2.0], [-1.0, -2.0], 2.0)
    out = compute_loss(inp, LossConfig())
    out.loss.backward()
    assert out.metrics["ratio_max"].item() == pytest.approx(1.0)
    torch.testing.assert_close(inp.logprobs.grad, torch.tensor([-1.0, -1.0]))


def test_metrics_are_device_tensors_without_item(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1))
    inp = _single_seq([-1.0, -2.0], [-1.1, -2.0], 1.0)
    out = compute_loss(inp, LossConfig(algo="gspo", kl_coef=0.1))
    assert calls == []
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.metrics.values())


def test_config_validation():
    with pytest.raises(ValueError, match="algo"):
        LossConfig(algo="ppo")
    with pytest.raises(ValueError, match="kl_type"):
        LossConfig(kl_type="k2")
    with pytest.raises(ValueError, match="clip"):
        LossConfig(clip_eps_low=1.5)
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=1.0)


def test_build_train_pack_unsplit_pack_has_zero_weights():
    b = random_batch(seed=9)
    pack = build_train_pack(b, np.zeros(b.num_responses, np.float32))
    assert torch.all(pack.seq_weights == 0)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("where", ["ratio", "kl", "behav"])
def test_a_log_ratio_of_100_gives_a_finite_loss_and_gradient_in_fp32(algo, adv, where):
    """One token 100 nats off (exp overflows fp32 above ~88.7) in pi_theta / pi_prox,
    ref / pi_theta (k3) or pi_prox / pi_behav: every log-ratio is clamped to +-20
    before exp (losses.LOG_RATIO_CLAMP), so the step is not lost to a NaN."""
    from areno.losses import LOG_RATIO_CLAMP

    f32 = dict(dtype=torch.float32)
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0], **f32)
    logp = old.clone()
    ref, rollout = old.clone(), old.clone()
    if where == "ratio":
        logp[0] += 100.0
    elif where == "kl":
        ref[0] += 100.0
    else:
        rollout[0] -= 100.0
    logp.requires_grad_(True)
    n = old.numel()
    inp = LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.full((n,), adv, **f32),
                     loss_mask=torch.ones(n, dtype=torch.bool), seq_weights=torch.tensor([1.0 / n], **f32),
                     seq_index=torch.zeros(n, dtype=torch.long), rollout_logprobs=rollout, ref_logprobs=ref)
    out = compute_loss(inp, LossConfig(algo=algo, kl_coef=0.1, kl_type="k3", tis_cap=2.0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all(), (out.loss, logp.grad)
    assert all(torch.isfinite(v) for v in out.metrics.values()), out.metrics
    if where == "ratio" and algo == "grpo":  # the token's ratio is e^20, exactly
        assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(LOG_RATIO_CLAMP), rel=1e-6)
