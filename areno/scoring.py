"""Decode and score a single-turn rollout with the reward plugin: whole
(score), or part by part as its groups finish (PartScorer: the colocated
round under --overlap-rewards, and engine processes' rounds, whose parts are
scored while the controller waits for the ranks). `data` is where the
prompts come from (producers.Data: the training set or the eval set)."""

from __future__ import annotations

from typing import Any

import numpy as np

from areno.fleet.rollouts import Parts
from areno.rewards import RewardResult, reward_records
from areno.rollout.batch import RolloutBatch, decode_completions
from areno.timing import PhaseTimer


def score(run: Any, data: Any, prompt_idx: np.ndarray, batch: RolloutBatch, timer: PhaseTimer) -> RewardResult:
    """Decode the whole batch in one call, then score it."""
    with timer("decode"):
        completions = decode_completions(run.tokenizer, batch)
    with timer("reward"):
        return run.scorer.score(reward_records(data.rows, data.prompts, prompt_idx, batch, completions))


class PartScorer(Parts):
    """One rollout's parts, each decoded and submitted to the reward workers as it
    comes (add: keep, then score); finish() waits for the rewards outstanding and puts batch and
    rewards back in prompt order, so the result equals score()'s. Decode goes
    to `timer`'s decode phase, the submits to a reward span."""

    def __init__(self, run: Any, data: Any, prompt_idx: np.ndarray, timer: PhaseTimer, n: int) -> None:
        super().__init__()
        self.run, self.data, self.prompt_idx, self.timer, self.n = run, data, prompt_idx, timer, n
        self.tickets: list[int] = []
        self.results: dict[int, RewardResult] = {}  # part -> its rewards, once collected (result)

    def score(self, pos: np.ndarray, part: RolloutBatch) -> None:
        """Decode a kept part and submit it to the reward workers."""
        run, n = self.run, self.n
        with self.timer("decode"):
            completions = decode_completions(run.tokenizer, part)
        index = pos[part.group_index] * n + np.arange(part.num_responses) % n
        with self.timer.span("reward"):
            self.tickets.append(run.scorer.submit(reward_records(
                self.data.rows, self.data.prompts, self.prompt_idx[pos], part, completions, index=index)))

    def result(self, i: int) -> RewardResult:
        """Part i's rewards, waited for once (--partial-rollouts takes a round's
        groups over several steps; finish() is then never called)."""
        if i not in self.results:
            with self.timer("reward"):
                self.results[i] = self.run.scorer.collect(self.tickets[i])
        return self.results[i]

    def finish(self, timer: PhaseTimer) -> tuple[RolloutBatch, RewardResult]:
        """-> (the batch, its rewards), both in prompt order."""
        with timer("reward"):
            results = [self.run.scorer.collect(t) for t in self.tickets]
        with timer.span("merge"):
            batch, perm = self.merge()  # one copy of the token arrays
            merged = RewardResult.concat(results)
        return batch, merged.take(perm)
