import dataclasses

import numpy as np
import pytest

from areno.advantages import zero_variance_groups
from areno.rollout.batch import (
    RolloutBatch,
    decode_completions,
    overlong_mask,
)
from helpers import (
    concat,
    keep_nonzero_variance,
    random_batch,
    random_rewards,
    select_responses,
    take_prompts,
)


def _fields(b: RolloutBatch) -> dict:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if getattr(b, f.name) is not None}


def test_valid_batch_sizes():
    b = random_batch(seed=1, group_sizes=[2, 3, 1])
    assert b.num_prompts == 3 and b.num_responses == 6
    assert b.response_lengths.sum() == b.num_response_tokens


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("prompt_ids", lambda b: b.prompt_ids.astype(np.int64), "prompt_ids: expected dtype int32"),
        ("response_ids", lambda b: b.response_ids.tolist(), "response_ids: expected a numpy array"),
        ("response_logprobs", lambda b: b.response_logprobs.astype(np.float64), "response_logprobs"),
        ("group_index", lambda b: b.group_index.astype(np.int32), "group_index: expected dtype int64"),
        ("finish_reason", lambda b: b.finish_reason.astype(np.int64), "finish_reason"),
        ("prompt_offsets", lambda b: b.prompt_offsets.astype(np.int32), "prompt_offsets"),
        ("response_offsets", lambda b: b.response_offsets[::-1].copy(), "response_offsets"),
        ("response_offsets", lambda b: b.response_offsets + 1, "response_offsets: must start at 0"),
        (
            "response_offsets",
            lambda b: np.concatenate([b.response_offsets[:-1], [b.response_offsets[-1] + 3]]),
            "response_offsets: last offset",
        ),
        (
            "prompt_offsets",
            lambda b: np.array([0, 5, 2, b.prompt_ids.size], dtype=np.int64),
            "prompt_offsets: not monotone",
        ),
        ("group_index", lambda b: b.group_index + 10, "group_index: values must lie"),
        ("group_index", lambda b: b.group_index[:-1], "group_index: length"),
        ("finish_reason", lambda b: np.full_like(b.finish_reason, 7), "finish_reason: values"),
        ("response_logprobs", lambda b: b.response_logprobs[:-1], "response_logprobs: length"),
        ("prompt_ids", lambda b: b.prompt_ids.reshape(1, -1), "prompt_ids: expected a 1-D"),
    ],
)
def test_validation_names_the_field(field, value, match):
    b = random_batch(seed=2, group_sizes=[2, 3, 1])
    f = _fields(b)
    f[field] = value(b)
    with pytest.raises(ValueError, match=match):
        RolloutBatch(**f)


def test_zero_variance_and_select():
    b = random_batch(seed=3, group_sizes=[3, 2, 1, 4])
    r = random_rewards(b, zero_var_groups=1)
    r[b.group_index == 3] = np.array([0.0, 1.0, 0.0, 1.0])
    zv = zero_variance_groups(r, b.group_index, b.num_prompts)
    assert zv[0] and zv[2]  # constant group, singleton group
    assert not zv[3]
    keep = keep_nonzero_variance(b, r)
    sub = select_responses(b, keep)
    kept = np.flatnonzero(keep)
    assert sub.num_responses == kept.size
    # per-response content matches the original, prompts renumbered densely
    for new_i, old_i in enumerate(kept):
        np.testing.assert_array_equal(sub.response_tokens(new_i), b.response_tokens(old_i))
        np.testing.assert_array_equal(
            sub.prompt_tokens(sub.group_index[new_i]), b.prompt_tokens(b.group_index[old_i])
        )
        np.testing.assert_array_equal(
            sub.response_logprobs[sub.response_offsets[new_i] : sub.response_offsets[new_i + 1]],
            b.response_logprobs[b.response_offsets[old_i] : b.response_offsets[old_i + 1]],
        )
    assert sub.num_prompts == len(set(b.group_index[kept].tolist()))


def test_overlong_mask():
    b = random_batch(seed=4)
    np.testing.assert_array_equal(overlong_mask(b), b.finish_reason == 1)


def test_overlong_mask_of_trajectories_is_their_last_turn_cut_through_take_and_merge():
    """A trajectory finishing `length` because --max-turns ended it is not overlong;
    turn_cut follows its responses through take_groups and merge_parts."""
    b = random_batch(seed=4, group_sizes=[2, 3])
    cut = np.arange(b.num_responses) % 2 == 0
    t = dataclasses.replace(b, finish_reason=np.ones(b.num_responses, np.uint8), turn_cut=cut)
    np.testing.assert_array_equal(overlong_mask(t), cut)
    sub, resp = t.take_groups(np.array([1]))
    np.testing.assert_array_equal(overlong_mask(sub), cut[resp])
    merged, perm = RolloutBatch.merge_parts([sub, b.take_groups(np.array([0]))[0]],
                                            [np.array([0]), np.array([1])])
    single = b.take_groups(np.array([0]))[0]
    np.testing.assert_array_equal(overlong_mask(merged),
                                  np.concatenate([cut[resp], single.finish_reason == 1])[perm])


def test_concat_renumbers():
    a, b = random_batch(seed=5, group_sizes=[2, 1]), random_batch(seed=6, group_sizes=[1, 3])
    c = concat([a, b])
    assert c.num_prompts == 4 and c.num_responses == 7
    np.testing.assert_array_equal(c.response_tokens(3), b.response_tokens(0))
    np.testing.assert_array_equal(c.prompt_tokens(c.group_index[3]), b.prompt_tokens(0))


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_chat_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_path)


class _CountingTokenizer:
    """A real fast tokenizer wrapped to count decode calls."""

    def __init__(self, tok):
        self.tok = tok
        self.backend_tokenizer = self
        self.calls = 0

    def decode_batch(self, seqs, skip_special_tokens=True):
        self.calls += 1
        return self.tok.backend_tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)


def test_decode_completions_is_one_batched_call(chat_tokenizer):
    texts = ["1+2=3", "hello world", "", "7 apples"]
    enc = [chat_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    lengths = np.array([len(e) for e in enc])
    ids = np.concatenate([np.asarray(e, dtype=np.int32) for e in enc])
    b = RolloutBatch(
        prompt_ids=np.array([1], np.int32),
        prompt_offsets=np.array([0, 1], np.int64),
        response_ids=ids,
        response_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        response_logprobs=np.zeros(ids.size, np.float32),
        group_index=np.zeros(len(texts), np.int64),
        finish_reason=np.zeros(len(texts), np.uint8),
    )
    counting = _CountingTokenizer(chat_tokenizer)
    out = decode_completions(counting, b)
    assert counting.calls == 1
    assert out == [chat_tokenizer.decode(e) for e in enc]


def test_take_prompts_reorders_groups_and_returns_the_response_permutation():
    b = random_batch(seed=31, group_sizes=[2, 1, 3, 2])
    order = np.array([2, 0, 3, 1])
    nb, perm = take_prompts(b, order)
    assert nb.num_prompts == 4 and nb.num_responses == b.num_responses
    for new_i, old_i in enumerate(perm):
        np.testing.assert_array_equal(nb.response_tokens(new_i), b.response_tokens(old_i))
        assert order[nb.group_index[new_i]] == b.group_index[old_i]
        np.testing.assert_array_equal(nb.prompt_tokens(nb.group_index[new_i]),
                                      b.prompt_tokens(b.group_index[old_i]))
    assert np.all(np.diff(nb.group_index) >= 0)
    back, _ = take_prompts(nb, np.argsort(order))
    np.testing.assert_array_equal(back.response_ids, b.response_ids)
    np.testing.assert_array_equal(back.response_logprobs, b.response_logprobs)


def _shuffle_responses(b: RolloutBatch, rng) -> RolloutBatch:
    """The same batch with its responses in a random order (groups interleaved)."""
    perm = rng.permutation(b.num_responses)
    lengths = b.response_lengths[perm]
    src = np.concatenate([np.arange(b.response_offsets[i], b.response_offsets[i + 1]) for i in perm]
                         + [np.zeros(0, np.int64)]).astype(np.int64)
    return dataclasses.replace(
        b, response_ids=b.response_ids[src], response_logprobs=b.response_logprobs[src],
        response_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        group_index=b.group_index[perm], finish_reason=b.finish_reason[perm])


@pytest.mark.parametrize("seed", range(12))
def test_merge_parts_equals_concat_then_take_prompts(seed):
    rng = np.random.default_rng(seed)
    num_parts = int(rng.integers(1, 6))
    parts = [random_batch(seed=100 * seed + i, num_prompts=int(rng.integers(1, 5)),
                          min_response=int(rng.integers(0, 2)))
             for i in range(num_parts)]
    if seed % 3 == 0:
        parts = [_shuffle_responses(b, rng) for b in parts]
    P = sum(b.num_prompts for b in parts)
    order = rng.permutation(P) if seed % 4 else np.arange(P)
    positions = np.split(order, np.cumsum([b.num_prompts for b in parts])[:-1])
    want, want_perm = take_prompts(concat(parts), np.argsort(np.concatenate(positions)))
    got, got_perm = RolloutBatch.merge_parts(parts, positions)
    for name, value in _fields(want).items():
        np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
        assert getattr(got, name).dtype == value.dtype, name
    np.testing.assert_array_equal(got_perm, want_perm)


def test_merge_parts_rejects_bad_positions():
    a, b = random_batch(seed=1, group_sizes=[2, 1]), random_batch(seed=2, group_sizes=[1])
    with pytest.raises(ValueError, match="permutation"):
        RolloutBatch.merge_parts([a, b], [np.array([0, 1]), np.array([1])])
    with pytest.raises(ValueError, match="positions for a part"):
        RolloutBatch.merge_parts([a, b], [np.array([0]), np.array([1, 2])])
    with pytest.raises(ValueError, match="parts"):
        RolloutBatch.merge_parts([a], [np.array([0, 1]), np.array([2])])
