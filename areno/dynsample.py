"""DAPO's dynamic sampling (--dynamic-sampling; Yu et al. 2025, section 3.2): a step
generates rounds of --batch-size prompts until --batch-size informative groups
are kept, at most --max-sampling-rounds rounds.

A group is informative when its rewards can move the policy:

  reward    its valid rewards (with the overlong punishment, what the advantages
            see) are not all equal (verl's filter_groups metric seq_final_reward)
  accuracy  some but not all of its valid samples are correct, reward >= 1
            (verl's metric acc; the demo's and gsm8k's rewards are 0/1)

`fill_batch` is the loop, independent of where rollouts come from: it takes a
`collect() -> Round` callable, the next round (colocated: generated and scored
now; under split placement the engine processes' loop supplies the rounds).
Rounds are kept whole in order, the groups of a round in prompt order, so the
kept batch depends only on the rounds, never on timing. Past --batch-size the
surplus of the last round is dropped (as verl's), and at the bound the step
trains on what it kept (verl raises instead), counted in sampling/bound_hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from areno.advantages import zero_variance_groups
from areno.choices import DynamicSampling
from areno.metrics import rounds_metrics, sampling_metrics
from areno.rewards import RewardCounts, RewardResult
from areno.rollout.batch import RolloutBatch

@dataclass(frozen=True)
class Round:
    """One rollout of a step, scored: prompt_idx [P] int64, batch of P groups."""

    prompt_idx: np.ndarray
    batch: RolloutBatch
    scored: RewardResult
    extra: dict = field(default_factory=dict)  # metrics of the round's own (env/*, multi-turn)

    def astuple(self) -> tuple[np.ndarray, RolloutBatch, RewardResult]:
        return self.prompt_idx, self.batch, self.scored


@dataclass(frozen=True)
class Filled:
    """What a step trains on, and what it cost. `round` holds the kept groups of all
    rounds in order (the last round whole, with `train` all False, if none was
    kept: its samples are reported, nothing is trained)."""

    round: Round
    train: np.ndarray            # [P] bool: groups to train on
    rounds: int
    generated_groups: int
    gen_tokens: int
    bound_hit: bool
    generated_reward: float      # mean valid reward of every round's samples, dropped ones too

    @staticmethod
    def whole(r: Round) -> "Filled":
        """One round, every group trained (--dynamic-sampling off)."""
        P = r.batch.num_prompts
        return Filled(r, np.ones(P, bool), 1, P, r.batch.num_response_tokens, False,
                      _mean_valid([r]))

    def metrics(self) -> dict[str, float]:
        return sampling_metrics(self.rounds, int(self.train.sum()), self.generated_groups,
                                self.gen_tokens, self.bound_hit, self.generated_reward)


def _mean_valid(rounds: list[Round]) -> float:
    """Mean valid reward over rounds: the policy's reward on fresh prompts, where the
    kept groups' (reward/mean) leaves out the all-right and all-wrong ones."""
    r = np.concatenate([x.scored.rewards[x.scored.valid] for x in rounds]).astype(np.float64)
    return float(r.mean()) if r.size else 0.0


def informative_groups(rewards: np.ndarray, valid: np.ndarray, group_index: np.ndarray,
                       num_groups: int, metric: DynamicSampling) -> np.ndarray:
    """[N] rewards (NaN where not valid), [N] bool valid, [N] group ids -> [P] bool:
    groups whose valid samples differ in reward (metric reward) or in correctness,
    reward >= 1 (metric accuracy). A group with fewer than two valid samples has no
    group-relative signal and is not informative."""
    r = np.asarray(rewards, dtype=np.float64)[valid]
    if metric == "accuracy":
        r = (r >= 1.0).astype(np.float64)
    return ~zero_variance_groups(r, np.asarray(group_index)[valid], num_groups)


def fill_batch(collect: Callable[[], Round], want: int, max_rounds: int,
               informative: Callable[[Round], np.ndarray]) -> Filled:
    """Collect rounds one after another until `want` informative groups are kept
    or `max_rounds` rounds ran; informative(round) -> [P] bool."""
    kept: list[Round] = []
    seen: list[Round] = []
    n_kept = 0
    while n_kept < want and len(seen) < max_rounds:
        seen.append(collect())
        groups = np.flatnonzero(informative(seen[-1]))[: want - n_kept]
        if groups.size:
            kept.append(take_groups(seen[-1], groups))
            n_kept += groups.size
    if not seen:
        raise ValueError("fill_batch: max_rounds must be >= 1")
    return filled_from(kept, seen, want, len(seen))


def filled_from(kept: list[Round], seen: list[Round], want: int, rounds: int) -> Filled:
    """The step's Filled from the kept parts of what it generated (`seen`, in
    order; `rounds` rounds' worth): every scored sample's outcome is reported,
    the last one seen is shown when nothing was kept."""
    n_kept = sum(r.batch.num_prompts for r in kept)
    counts = RewardCounts()
    for r in seen:
        counts = counts + r.scored.counts
    out, train = ((concat_rounds(kept), np.ones(n_kept, bool)) if kept
                  else (seen[-1], np.zeros(seen[-1].batch.num_prompts, bool)))
    extra = rounds_metrics([(r.extra, r.batch.num_responses) for r in seen]) if len(seen) > 1 else seen[-1].extra
    out = replace(out, scored=replace(out.scored, counts=counts), extra=extra)
    return Filled(out, train, rounds, sum(r.batch.num_prompts for r in seen),
                  sum(r.batch.num_response_tokens for r in seen), n_kept < want, _mean_valid(seen))


def take_groups(r: Round, groups: np.ndarray) -> Round:
    """The groups `groups` of a round, with their prompts and rewards."""
    batch, resp = r.batch.take_groups(groups)
    return Round(r.prompt_idx[groups], batch, r.scored.take(resp))


def concat_rounds(parts: list[Round]) -> Round:
    """Rounds one after the other (prompt order: round by round)."""
    if len(parts) == 1:
        return parts[0]
    sizes = np.cumsum([0] + [p.batch.num_prompts for p in parts])
    positions = [np.arange(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
    batch, _ = RolloutBatch.merge_parts([p.batch for p in parts], positions)  # in order: no perm
    return Round(np.concatenate([p.prompt_idx for p in parts]), batch,
                 RewardResult.concat([p.scored for p in parts]))
