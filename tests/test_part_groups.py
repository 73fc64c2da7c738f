"""A round's streamed parts as groups (areno/part_groups.py): when each group
arrived, and any complete ones taken with their rewards, equal to taking them
from the whole round; a part's reward counts reported once."""

from __future__ import annotations

import numpy as np
import pytest

from areno.part_groups import arrival, groups_of_parts
from areno.rewards import RewardCounts, RewardResult
from helpers import random_batch


class Sink:
    """Parts of a round (fleet/rollouts.Parts' fields), scored or not."""

    def __init__(self, parts, positions, results) -> None:
        self.parts, self.positions, self._results = parts, positions, results

    def result(self, i: int):
        return None if self._results is None else self._results[i]


def split(batch, positions):
    """The round's groups at `positions` (one list per part) as parts, with rewards
    = 10 * group + sample (so a wrong gather shows) and one error per part."""
    parts, results = [], []
    for q in positions:
        part, resp = batch.take_groups(np.asarray(q))
        parts.append(part)
        rewards = (10 * batch.group_index[resp] + np.arange(resp.size)).astype(np.float32)
        results.append(RewardResult(rewards, np.ones(resp.size, bool), RewardCounts(errors=1)))
    return parts, [np.asarray(q, np.int64) for q in positions], results


def test_taken_groups_equal_the_whole_rounds_and_their_rewards_follow_them() -> None:
    batch = random_batch(seed=3, num_prompts=6)
    parts, positions, results = split(batch, [[4, 1], [0], [5, 2]])  # 3 not arrived
    done = arrival(positions, [2.0, 1.0, 3.0], 6)
    assert done.tolist() == [1.0, 2.0, 3.0, np.inf, 2.0, 3.0]
    counted: set[int] = set()
    got, scored = groups_of_parts(Sink(parts, positions, results), np.array([2, 0, 4]), counted)
    want, resp = batch.take_groups(np.array([2, 0, 4]))
    for f in ("prompt_ids", "prompt_offsets", "response_ids", "response_offsets", "response_logprobs",
              "group_index", "finish_reason"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    assert (scored.rewards // 10).tolist() == batch.group_index[resp].tolist()
    assert scored.counts.errors == 3 and counted == {0, 1, 2}
    # part 0 again (group 1): its errors were reported already
    _, again = groups_of_parts(Sink(parts, positions, results), np.array([1]), counted)
    assert again.counts.errors == 0 and (again.rewards // 10 == 1).all()
    unscored, none = groups_of_parts(Sink(parts, positions, None), np.array([5]), set())
    assert none is None and unscored.num_prompts == 1
    with pytest.raises(ValueError, match=r"groups \[3\] have not arrived"):
        groups_of_parts(Sink(parts, positions, results), np.array([3, 0]), set())
