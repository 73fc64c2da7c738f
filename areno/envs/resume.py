"""Multi-turn trajectories a Ctrl-C halted, continued by the resumed run before
its first step (Producer.continue_halted).

Under --partial-rollouts a Ctrl-C ends every request the engines hold at their
next decode step (fleet/inflight_loads.py's halt); the episode driver ends each
trajectory so stopped with finish "abort" and its books (envs/halted.py:
whether a turn was cut, its turns, its environment's state after the last step
that answered; a trajectory whose environment call was out is not waited
for, its call due). The checkpoint saves them with the round. Resumed,
each round's driver (the rounds in one loop: envs/rounds.py) starts each
trajectory where it stopped: its tokens, log-probs, versions and
mask as saved, its reward so far, its state; a cut turn is sampled on from its
prompt, trajectory and tokens so far with what is left of --max-new-tokens,
and the whole turn's text goes to the environment; a trajectory halted
between turns takes its next turn; a due step (or reset) is asked again. The
new tokens are spliced onto the saved ones (areno/continuation.py), stamped
with the resumed engines' version.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from areno.continuation import splice, tails
from areno.envs.driver import EpisodeHost, EpisodeSpec
from areno.envs.rounds import run_rounds
from areno.rewards.plugin import RewardResult
from areno.rollout.batch import RolloutBatch, csr_take
from areno.rollout.engine import SamplingConfig


def halted_episodes(scored: RewardResult | None) -> np.ndarray:
    """[m] int64: the trajectories of a multi-turn round a halt ended (its rewards'
    payloads: envs/halted.Halted records)."""
    if scored is None or scored.payloads is None:
        return np.zeros(0, np.int64)
    return np.flatnonzero([p is not None for p in scored.payloads]).astype(np.int64)


class _Stamped:
    """The engines, every token they sample stamped with the weights' version they hold."""

    def __init__(self, engine: Any, version: int) -> None:
        self.engine, self.version, self.max_model_len = engine, version, engine.max_model_len

    def generate_stream(self, ids: np.ndarray, offsets: np.ndarray, n: int, sampling: SamplingConfig,
                        min_groups: int = 1):
        for pos, part in self.engine.generate_stream(ids, offsets, n, sampling, min_groups=min_groups):
            yield pos, replace(part, token_version=np.full(part.response_ids.size, self.version, np.int32))


def continue_episodes(engine: Any, spec: EpisodeSpec, rounds: list[tuple[RolloutBatch, RewardResult,
                                                                       SamplingConfig, int]],
                      version: int) -> list[tuple[RolloutBatch, RewardResult]]:
    """Saved multi-turn rounds, each (batch with response_mask, its rewards with
    the Halted payloads, its sampling, the version of its tokens where the batch
    records none) -> each round with every halted trajectory run to its end by
    `engine` (holding weights `version`), the rounds in one loop (envs/rounds.py:
    one's environment waits filled with another's turns) over environment
    workers of their own; rewards sum on (or replace: --env-reward last)."""
    host, stamped = EpisodeHost(), _Stamped(engine, version)
    outs: dict[int, Any] = {}
    try:
        queued = [_restored(host, stamped, spec, batch, scored, sampling) for batch, scored, sampling, _ in rounds]
        while queued:  # a loop admits the next round only while its own wait on environments
            base = len(outs)
            run_rounds(queued.pop(0), lambda: queued.pop(0) if queued else None,
                       lambda k, out: outs.__setitem__(base + k, out))
    finally:
        host.close()
    return [_spliced(batch, scored, outs[k], round_version, version)
            for k, (batch, scored, _, round_version) in enumerate(rounds)]


def _restored(host: EpisodeHost, engine: Any, spec: EpisodeSpec, batch: RolloutBatch, scored: RewardResult,
              sampling: SamplingConfig) -> Any:
    """A driver (not started) of a round's halted trajectories, each restored as saved."""
    which = halted_episodes(scored)
    records = [scored.payloads[i] for i in which.tolist()]
    ids, offsets = csr_take(batch.prompt_ids, batch.prompt_offsets, batch.group_index[which])
    d = host.driver(engine, spec, ids, offsets, [r.state for r in records], 1, sampling)
    off = batch.response_offsets
    for j, (i, r) in enumerate(zip(which.tolist(), records)):
        a, b = off[i], off[i + 1]
        d.traj.restore(j, batch.response_ids[a:b], batch.response_logprobs[a:b], batch.response_mask[a:b],
                       None if batch.token_version is None else batch.token_version[a:b], r.turns)
        d.reward[j], d.turn_tokens[j] = scored.rewards[i], r.turn_tokens
        d.last_token[j] = batch.response_ids[b - 1] if b > a else -1
        d.restored[j] = r
    return d


def _spliced(batch: RolloutBatch, scored: RewardResult, out: Any, round_version: int,
             version: int) -> tuple[RolloutBatch, RewardResult]:
    """A saved round with its halted trajectories' continuations (`out`, their
    EnvRollout) spliced on, and their rewards."""
    which = halted_episodes(scored)
    cont = tails(out.batch, np.diff(batch.response_offsets)[which])
    whole = splice(batch, which, cont, np.diff(cont.response_offsets), round_version, version)
    rewards, valid = scored.rewards.copy(), scored.valid.copy()
    rewards[which], valid[which] = out.scored.rewards, out.scored.valid
    return whole, RewardResult(rewards, valid, scored.counts + out.scored.counts, scored.messages)
