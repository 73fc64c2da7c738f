import dataclasses

import numpy as np
import pytest
import torch

from areno.pack import build_padded_pack, build_train_pack
from areno.split import aggregation_weights, build_split_pack, plan_split
from helpers import random_batch, split_pack


def reference_sequences(batch, adv):
    """Per-sample Python lists: what a list-based trainer builds."""
    out = []
    for i in range(batch.num_responses):
        prompt = batch.prompt_tokens(batch.group_index[i]).tolist()
        resp = batch.response_tokens(i).tolist()
        if not resp:
            continue
        lp = batch.response_logprobs[batch.response_offsets[i] : batch.response_offsets[i + 1]].tolist()
        full = prompt + resp
        n_in = len(full) - 1
        mask = [j >= len(prompt) - 1 for j in range(n_in)]
        old = [0.0] * (len(prompt) - 1) + lp
        a = [0.0] * (len(prompt) - 1) + [float(adv[i])] * len(resp)
        out.append(
            dict(index=i, input_ids=full[:-1], targets=full[1:], mask=mask, old=old, adv=a,
                 pos=list(range(n_in)))
        )
    return out


def _check_pack_against_reference(pack, batch, adv, ref_by_index):
    cu = pack.cu_seqlens.tolist()
    assert pack.cu_seqlens.dtype == torch.int32
    for s, i in enumerate(pack.sample_index.tolist()):
        ref = ref_by_index[i]
        a, b = cu[s], cu[s + 1]
        assert pack.input_ids[a:b].tolist() == ref["input_ids"]
        assert pack.targets[a:b].tolist() == ref["targets"]
        assert pack.position_ids[a:b].tolist() == ref["pos"]
        assert pack.loss_mask[a:b].tolist() == ref["mask"]
        np.testing.assert_allclose(pack.old_logprobs[a:b].numpy(), ref["old"], rtol=0, atol=0)
        np.testing.assert_allclose(pack.advantages[a:b].numpy(), ref["adv"], rtol=0, atol=0)
        assert (pack.seq_index[a:b] == s).all()


@pytest.mark.parametrize("seed", range(6))
def test_pack_matches_list_reference(seed):
    b = random_batch(seed=seed, num_prompts=7, max_prompt=6, max_response=8)
    adv = np.random.default_rng(seed).standard_normal(b.num_responses).astype(np.float32)
    pack = build_train_pack(b, adv)
    ref = {r["index"]: r for r in reference_sequences(b, adv)}
    assert pack.num_seqs == len(ref)
    assert pack.num_tokens == sum(len(r["input_ids"]) for r in ref.values())
    assert int(pack.loss_mask.sum()) == b.num_response_tokens
    _check_pack_against_reference(pack, b, adv, ref)


def test_empty_responses_are_skipped_and_order_respected():
    b = random_batch(seed=11, group_sizes=[3, 2], min_response=0, max_response=3)
    adv = np.arange(b.num_responses, dtype=np.float32)
    pack = build_train_pack(b, adv)
    nonempty = np.flatnonzero(b.response_lengths > 0)
    np.testing.assert_array_equal(pack.sample_index.numpy(), nonempty)
    order = nonempty[::-1].copy()
    rev = build_train_pack(b, adv, order=order)
    ref = {r["index"]: r for r in reference_sequences(b, adv)}
    _check_pack_against_reference(rev, b, adv, ref)


def test_pack_validation():
    b = random_batch(seed=1)
    with pytest.raises(ValueError, match="advantages"):
        build_train_pack(b, np.zeros(b.num_responses + 1, np.float32))


@pytest.mark.parametrize("case", ["single-turn", "observations", "reordered"])
def test_padded_has_the_same_meaning(case):
    b = random_batch(seed=3)
    rng = np.random.default_rng(3)
    adv = rng.standard_normal(b.num_responses).astype(np.float32)
    order = None
    if case == "observations":  # a multi-turn batch: some response tokens are not sampled
        b = dataclasses.replace(b, response_mask=(rng.random(b.response_ids.size) < 0.7).astype(np.uint8))
    if case == "reordered":
        order = rng.permutation(np.flatnonzero(b.response_lengths > 0))[:-2]
    pack = build_train_pack(b, adv, order=order)
    pad = build_padded_pack(b, adv, order=order, pad_id=-1)
    lengths = pack.seq_lengths
    assert pad.input_ids.shape == (pack.num_seqs, lengths.max())
    assert torch.equal(pad.sample_index, pack.sample_index)
    cu = pack.cu_seqlens.tolist()
    for s in range(pack.num_seqs):
        n, a = lengths[s], cu[s]
        for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages"):
            assert torch.equal(getattr(pad, f)[s, :n], getattr(pack, f)[a : a + n]), f
        assert (pad.input_ids[s, n:] == -1).all() and (pad.targets[s, n:] == -1).all()
        assert pad.attention_mask[s].sum() == n
        assert not pad.loss_mask[s, n:].any()
        assert not pad.old_logprobs[s, n:].any() and not pad.advantages[s, n:].any()


def test_plan_split_is_balanced_deterministic_and_budgeted():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, 97)
    p1 = plan_split(lengths, 4, max_tokens=300, num_minibatches=3)
    p2 = plan_split(lengths, 4, max_tokens=300, num_minibatches=3)
    np.testing.assert_array_equal(p1.seq_order, p2.seq_order)
    np.testing.assert_array_equal(p1.micro_seqs, p2.micro_seqs)
    assert sorted(p1.seq_order.tolist()) == list(range(97))
    assert p1.imbalance < 1.1
    new_len = lengths[p1.seq_order]
    R, K, M, _ = p1.micro_seqs.shape
    for r in range(R):
        for k in range(K):
            for m in range(M):
                a, b = p1.micro_seqs[r, k, m]
                assert new_len[a:b].sum() <= 300
                assert np.all(p1.minibatch[a:b] == k)
    # rank-major: each rank's sequences are one contiguous range
    assert p1.micro_seqs[0, 0, 0, 0] == 0 and p1.micro_seqs[-1, -1, -1, 1] == 97


def test_plan_long_sequence_gets_own_microbatch_and_empty_ranks_pad():
    p = plan_split(np.array([500, 10]), 3, max_tokens=100)
    sizes = p.micro_seqs[..., 1] - p.micro_seqs[..., 0]
    assert sizes.sum() == 2
    assert p.micro_seqs.shape[:2] == (3, 1)  # every rank runs the same number of micro-batches


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_weights_sum_to_the_right_normaliser(mode):
    b = random_batch(seed=5, num_prompts=8)
    adv = np.ones(b.num_responses, np.float32)
    sp = build_split_pack(b, adv, world_size=2, max_tokens=16, num_minibatches=2,
                          loss_agg=mode, norm_len=9)
    w_tok = sp.pack.seq_weights[sp.pack.seq_index.long()] * sp.pack.loss_mask
    mb = torch.from_numpy(sp.plan.minibatch)[sp.pack.seq_index.long()]
    for k in range(2):
        total = w_tok[mb == k].sum().item()
        if mode == "seq-mean-token-sum-norm":
            seqs = (sp.plan.minibatch == k).sum()
            tokens = sp.pack.loss_mask[mb == k].sum().item()
            assert total == pytest.approx(tokens / (9 * seqs), rel=1e-5)
        else:
            assert total == pytest.approx(1.0, rel=1e-5)


def test_split_pack_micro_views_cover_everything():
    b = random_batch(seed=6, num_prompts=10)
    adv = np.random.default_rng(6).standard_normal(b.num_responses).astype(np.float32)
    sp = build_split_pack(b, adv, world_size=2, max_tokens=20, num_minibatches=2)
    ref = {r["index"]: r for r in reference_sequences(b, adv)}
    seen = []
    for r in range(2):
        lo, hi = sp.rank_seq_range(r)
        for k in range(sp.num_minibatches):
            for m in range(sp.num_micro):
                mbp = sp.micro(r, k, m)
                assert lo <= sp.plan.micro_seqs[r, k, m, 0] <= sp.plan.micro_seqs[r, k, m, 1] <= hi
                assert mbp.num_tokens <= 20 or mbp.num_seqs == 1
                if mbp.num_seqs:
                    assert mbp.local_seq_index()[0] == 0
                _check_pack_against_reference(
                    type(mbp)(**{**mbp.__dict__, "seq_index": mbp.local_seq_index()}), b, adv, ref
                )
                seen += mbp.sample_index.tolist()
    assert sorted(seen) == sorted(ref)
    # reordering an existing pack gives the same layout
    again = split_pack(build_train_pack(b, adv), 2, 20, num_minibatches=2)
    assert torch.equal(again.pack.input_ids, sp.pack.input_ids)
    assert torch.equal(again.pack.seq_weights, sp.pack.seq_weights)


def test_aggregation_weights_validation():
    p = plan_split(np.array([3, 4]), 1, 10)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregation_weights(np.array([2, 3]), p, "sum")
    with pytest.raises(ValueError, match="norm_len"):
        aggregation_weights(np.array([2, 3]), p, "seq-mean-token-sum-norm")


def test_workspace_reuses_buffers_and_gives_identical_packs():
    from areno.pack import Workspace

    ws = Workspace()
    b1, b2 = random_batch(seed=21, num_prompts=8), random_batch(seed=22, num_prompts=5)
    adv1 = np.random.default_rng(1).standard_normal(b1.num_responses).astype(np.float32)
    adv2 = np.random.default_rng(2).standard_normal(b2.num_responses).astype(np.float32)
    p1 = build_train_pack(b1, adv1, workspace=ws)
    ptr = p1.input_ids.data_ptr()
    fresh1 = build_train_pack(b1, adv1)
    for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(getattr(p1, f), getattr(fresh1, f)), f
    p2 = build_train_pack(b2, adv2, workspace=ws)  # smaller: fits the same buffers
    assert p2.input_ids.data_ptr() == ptr
    fresh2 = build_train_pack(b2, adv2)
    for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(getattr(p2, f), getattr(fresh2, f)), f


@pytest.mark.parametrize("reorder", [False, True])
def test_no_response_mask_packs_exactly_as_an_all_ones_mask(reorder):
    """A single-turn batch (response_mask None) skips the observation-token work;
    its pack is bit-identical to the same batch marked all sampled."""
    from areno.rollout.batch import RolloutBatch

    b = random_batch(seed=31, num_prompts=6, min_response=0, max_response=9)
    ones = RolloutBatch(**{**b.__dict__, "response_mask": np.ones(b.response_ids.size, dtype=np.uint8)})
    adv = np.random.default_rng(31).standard_normal(b.num_responses).astype(np.float32)
    order = np.flatnonzero(b.response_lengths > 0)
    order = order[::-1].copy() if reorder else order
    got, want = build_train_pack(b, adv, order=order), build_train_pack(ones, adv, order=order)
    for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages", "seq_index",
              "cu_seqlens", "sample_index"):
        assert getattr(got, f).dtype == getattr(want, f).dtype and torch.equal(getattr(got, f), getattr(want, f)), f
    assert int(got.loss_mask.sum()) == b.num_response_tokens


def test_in_order_and_reordered_packs_agree_sequence_by_sequence_with_a_mask():
    """The in-order pack (response arrays used as they lie) and a reordered one
    (gathered) hold the same sequences, multi-turn observation mask included."""
    from areno.rollout.batch import RolloutBatch

    b = random_batch(seed=41, num_prompts=6, min_response=0, max_response=9)
    rng = np.random.default_rng(41)
    m = (rng.random(b.response_ids.size) < 0.6).astype(np.uint8)
    b = RolloutBatch(**{**b.__dict__, "response_mask": m})
    adv = rng.standard_normal(b.num_responses).astype(np.float32)
    order = np.flatnonzero(b.response_lengths > 0)
    fwd, rev = build_train_pack(b, adv), build_train_pack(b, adv, order=order[::-1].copy())
    assert int(fwd.loss_mask.sum()) == int(m.sum())
    S = fwd.num_seqs
    for s in range(S):
        a, z = fwd.cu_seqlens[s], fwd.cu_seqlens[s + 1]
        ra, rz = rev.cu_seqlens[S - 1 - s], rev.cu_seqlens[S - s]
        for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs", "advantages"):
            assert torch.equal(getattr(fwd, f)[a:z], getattr(rev, f)[ra:rz]), (s, f)
