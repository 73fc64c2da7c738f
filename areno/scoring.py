"""Decode and score a rollout: whole (score), or part by part as its groups
finish (PartScorer: the colocated loop's --overlap-rewards, and split
placement's rollouts in flight, whose parts are scored while the controller
waits for the ranks)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from areno.backend.rank_engines import Parts
from areno.rewards import RewardResult, reward_records
from areno.rollout.batch import RolloutBatch, decode_completions
from areno.timing import PhaseTimer


def score(run: Run, prompt_idx: np.ndarray, batch: RolloutBatch, timer: PhaseTimer) -> RewardResult:
    """Decode the whole batch in one call, then score it."""
    with timer("decode"):
        completions = decode_completions(run.tokenizer, batch)
    with timer("reward"):
        return run.scorer.score(reward_records(run.rows, run.prompts, prompt_idx, batch, completions))


class PartScorer(Parts):
    """One rollout's parts, each decoded and submitted to the reward workers as it
    comes (add: keep, then score); finish() waits for the rewards outstanding and puts batch and
    rewards back in prompt order, so the result equals score()'s. Decode goes
    to `timer`'s decode phase, the submits to a reward span."""

    def __init__(self, run: Any, prompt_idx: np.ndarray, timer: PhaseTimer) -> None:
        super().__init__()
        self.run, self.prompt_idx, self.timer = run, prompt_idx, timer
        self.tickets: list[int] = []

    def score(self, pos: np.ndarray, part: RolloutBatch) -> None:
        """Decode a kept part and submit it to the reward workers."""
        run, n = self.run, self.run.cfg.n_samples
        with self.timer("decode"):
            completions = decode_completions(run.tokenizer, part)
        index = pos[part.group_index] * n + np.arange(part.num_responses) % n
        with self.timer.span("reward"):
            self.tickets.append(run.scorer.submit(reward_records(
                run.rows, run.prompts, self.prompt_idx[pos], part, completions, index=index)))

    def finish(self, timer: PhaseTimer) -> tuple[RolloutBatch, RewardResult]:
        """-> (the batch, its rewards), both in prompt order."""
        with timer("reward"):
            results = [self.run.scorer.collect(t) for t in self.tickets]
        with timer.span("merge"):
            batch, perm = self.merge()  # one copy of the token arrays
            merged = RewardResult.concat(results)
        return batch, replace(merged, rewards=merged.rewards[perm], valid=merged.valid[perm])
