"""Multi-turn trajectories in the flat layout: observation tokens carry no
gradient, no loss, no KL and no statistics; trajectories are assembled from
the sampled arrays without re-tokenizing (docs/DESIGN.md, "Multi-turn")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areno.envs.trajectory import ObservationFormat, Trajectories
from areno.rollout.batch import turn_segments
from areno.losses import LossConfig, LossInputs, compute_loss
from areno.rollout.batch import RolloutBatch
from areno.split import build_split_pack
from tests.helpers import random_batch


def with_mask(b: RolloutBatch, seed: int) -> RolloutBatch:
    """b with a random observation mask (at least one sampled token per response)."""
    rng = np.random.default_rng(seed)
    m = (rng.random(b.response_ids.size) < 0.6).astype(np.uint8)
    m[b.response_offsets[:-1]] = 1
    return RolloutBatch(**{**b.__dict__, "response_mask": m})


def _inputs(pack, logp, ref, ent):
    return LossInputs(logprobs=logp, old_logprobs=pack.old_logprobs.double(),
                      advantages=pack.advantages.double(), loss_mask=pack.loss_mask,
                      seq_weights=pack.seq_weights.double(), seq_index=pack.local_seq_index(),
                      ref_logprobs=ref, entropy=ent)


def test_pack_trains_only_sampled_tokens():
    b = with_mask(random_batch(seed=3, num_prompts=5, max_response=9), 3)
    adv = np.arange(b.num_responses, dtype=np.float32) + 1
    sp = build_split_pack(b, adv, world_size=1, max_tokens=10_000)
    p = sp.pack
    # targets on the mask are exactly the sampled response tokens, in pack order
    order = p.sample_index.numpy()
    want = np.concatenate([b.response_tokens(i)[b.response_mask[b.response_offsets[i]:b.response_offsets[i + 1]] == 1]
                           for i in order])
    assert np.array_equal(p.targets.numpy()[p.loss_mask.numpy()], want)
    off = ~p.loss_mask.numpy()
    assert not p.advantages.numpy()[off].any() and not p.old_logprobs.numpy()[off].any()
    assert int(p.loss_mask.sum()) == int(b.response_mask.sum())


@pytest.mark.parametrize("algo,kl", [("grpo", 0.0), ("grpo", 0.1), ("gspo", 0.1)])
def test_observation_tokens_get_zero_gradient_and_do_not_move_the_loss(algo, kl):
    b = with_mask(random_batch(seed=5, num_prompts=6, max_response=8), 5)
    rng = np.random.default_rng(5)
    adv = rng.standard_normal(b.num_responses).astype(np.float32)
    sp = build_split_pack(b, adv, world_size=1, max_tokens=10_000, loss_agg="seq-mean-token-mean")
    p, L = sp.pack, sp.pack.num_tokens
    cfg = LossConfig(algo=algo, kl_coef=kl, entropy_coef=0.01,
                     **({} if algo == "grpo" else dict(clip_eps_low=3e-4, clip_eps_high=4e-4)))
    base = p.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.3, L))
    ref = p.old_logprobs.double() + torch.from_numpy(rng.normal(0, 0.2, L))
    ent = torch.from_numpy(rng.random(L))
    logp = base.clone().requires_grad_(True)
    out = compute_loss(_inputs(p, logp, ref, ent), cfg)
    out.loss.backward()
    obs = ~p.loss_mask
    # observation (and prompt) positions: exactly zero gradient; sampled ones: some
    assert torch.count_nonzero(logp.grad[obs]) == 0
    assert torch.count_nonzero(logp.grad[p.loss_mask]) > 0
    # anything at those positions (new, reference, entropy) leaves loss and metrics as they are
    noise = torch.from_numpy(rng.normal(0, 5, L)) * obs
    out2 = compute_loss(_inputs(p, base + noise, ref - noise, ent + noise.abs()), cfg)
    assert torch.equal(out.loss.detach(), out2.loss)
    for k, v in out.metrics.items():
        assert torch.equal(v, out2.metrics[k]), k


def test_aggregation_counts_sampled_tokens_only():
    b = with_mask(random_batch(seed=7, num_prompts=4, max_response=9), 7)
    sp = build_split_pack(b, np.ones(b.num_responses, np.float32), world_size=1, max_tokens=10_000,
                          loss_agg="seq-mean-token-mean")
    order = sp.pack.sample_index.numpy()
    want = 1.0 / (b.policy_lengths[order] * order.size)
    assert np.allclose(sp.pack.seq_weights.numpy(), want)


def test_take_groups_and_merge_parts_keep_the_mask():
    b = with_mask(random_batch(seed=9, num_prompts=5), 9)
    part, resp = b.take_groups(np.array([3, 1]))
    for j, i in enumerate(resp.tolist()):
        assert [(m, a.tolist()) for m, a in turn_segments(part, j)] == \
            [(m, a.tolist()) for m, a in turn_segments(b, i)]
    rest, _ = b.take_groups(np.array([0, 2, 4]))
    merged, _ = RolloutBatch.merge_parts([part, rest], [np.array([3, 1]), np.array([0, 2, 4])])
    assert np.array_equal(merged.response_mask, b.response_mask)
    assert np.array_equal(merged.response_ids, b.response_ids)


def test_trajectory_is_the_sampled_arrays_and_observations_appended():
    prompts = np.array([5, 6, 7, 8, 9], np.int32)
    t = Trajectories(prompts, np.array([0, 2, 5]), np.array([0, 1, 1]))
    t.add_turn(1, np.array([11, 12]), np.array([-0.5, -0.25]))
    t.add_observation(1, np.array([40, 41, 42]))
    t.add_turn(0, np.array([13]), np.array([-1.0]))
    t.add_turn(1, np.array([14]), np.array([-2.0]))
    ids, off = t.context(np.array([1, 0, 2]))
    assert np.split(ids, off[1:-1])[0].tolist() == [7, 8, 9, 11, 12, 40, 41, 42, 14]
    assert np.split(ids, off[1:-1])[1].tolist() == [5, 6, 13]
    assert np.split(ids, off[1:-1])[2].tolist() == [7, 8, 9]
    b = t.to_batch(np.zeros(3, np.uint8), np.zeros(3, bool))
    assert b.response_tokens(1).tolist() == [11, 12, 40, 41, 42, 14]
    assert b.response_mask[b.response_offsets[1]:b.response_offsets[2]].tolist() == [1, 1, 0, 0, 0, 1]
    assert b.response_logprobs[b.response_offsets[1]:b.response_offsets[2]].tolist() == [-0.5, -0.25, 0, 0, 0, -2.0]
    assert [m for m, _ in turn_segments(b, 1)] == [1, 0, 1]


def test_observation_format_follows_the_chat_template(tiny_chat_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    fmt = ObservationFormat(tok, True, (eos,))
    # a turn that stopped on <|im_end|>: the template's newline, the user turn, the next header
    assert fmt.text("7", stopped=True) == "\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by the length limit gets the end-of-turn marker first
    assert fmt.text("7", stopped=False) == "<|im_end|>\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"
    ids = fmt.tokens("7", last_token=eos)
    assert tok.decode(ids.tolist()) == fmt.text("7", stopped=True)
    plain = ObservationFormat(tok, False, (eos,))
    assert plain.text(" 7", stopped=True) == " 7"
