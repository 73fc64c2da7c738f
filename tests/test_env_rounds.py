"""envs/rounds.py: several multi-turn rounds in one loop over one engine, a
queued one starting while the running one's trajectories wait on their envs
(the multi-turn tail fill of --partial-rollouts, fleet/episode_rounds.py)."""

from __future__ import annotations

import numpy as np

from areno.envs.driver import EnvBounds, driver
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.envs.rounds import run_rounds
from areno.envs.trajectory import ObservationFormat
from areno.rollout.engine import SamplingConfig
from test_env_driver import _setup, hf_engine, tok  # noqa: F401  (fixtures)

SLOW_FIRST = '''
import time
def step(state, completion):
    state.data["n"] = state.data.get("n", 0) + 1
    time.sleep(0.5 if state.row.get("slow") else 0.0)
    return f"seen {state.data['n']}", 1.0, state.data["n"] >= 2
'''


def test_a_queued_round_runs_while_the_running_ones_trajectories_wait_on_their_envs(hf_engine, tok, tmp_path):
    """Round 0's env answers after 0.5 s a step; round 1, admitted as soon as
    every trajectory of round 0 waits, plays its two turns meanwhile and ends
    first; both rollouts are whole (every trajectory two turns, its tokens
    sampled), each streamed part of groups goes to its own round, and the
    engine's waits count once, on the round running."""
    rows0, rows1 = [{"slow": True}, {"slow": True}], [{}, {}]
    env, ids, off, states0 = _setup(tok, tmp_path, rows0, n=2)
    _, _, _, states1 = _setup(tok, tmp_path, rows1, n=2)
    env.write_text(SLOW_FIRST)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    s = SamplingConfig(max_tokens=4, seed=3)
    parts: dict[int, list] = {0: [], 1: []}
    ended: list[tuple[int, object]] = []
    with EnvPool(str(env), workers=4, timeout=60) as pool:
        def make(k: int, states: list[EnvState]):
            return driver(hf_engine, pool, tok, fmt, ids, off, states, 2, s, EnvBounds(max_turns=3),
                          emit=parts[k].append)
        queued = [make(1, states1)]
        run_rounds(make(0, states0), lambda: queued.pop() if queued else None,
                   lambda k, out: ended.append((k, out)))
    assert [k for k, _ in ended] == [1, 0]  # the queued round ended first
    for k, out in ended:
        assert out.turns.tolist() == [2, 2, 2, 2] and out.batch.num_responses == 4
        assert np.all(out.batch.response_lengths > 0)
        assert sorted(p for part in parts[k] for p in part.positions.tolist()) == [0, 1]
    slow = dict(ended)[0]
    assert slow.engine_idle_s > 0.5  # the waits on round 0's envs once round 1 had ended
    assert dict(ended)[1].engine_idle_s < 0.5
