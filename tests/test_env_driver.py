"""The multi-turn driver on a real (tiny) model with its chat template: token
in, token out; the bounds; trajectories advance while another waits on its env;
groups go out as they end, and several rounds share one loop (envs/rounds.py)."""

from __future__ import annotations

import numpy as np
import pytest

from areno.envs.driver import EnvBounds, rollout_multiturn
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.envs.trajectory import ObservationFormat
from areno.metrics import ENV_METRICS
from areno.rollout.batch import FINISH_LENGTH, FINISH_STOP, overlong_mask
from areno.rollout.engine import SamplingConfig
from tests.env_trace import TracingEngine, assert_token_in_token_out

ENV = '''
import os, time
def reset(state):
    state.data["moves"] = 0
def step(state, completion):
    state.data["moves"] += 1
    wait = state.row.get("wait_for", 0)
    if state.index == 0 and state.turn == 0 and wait:  # until the others finished, at most 60 s
        t_end = time.monotonic() + 60
        names = [os.path.join(state.row["dir"], f"done{j}") for j in range(1, wait + 1)]
        while not all(map(os.path.exists, names)) and time.monotonic() < t_end:
            time.sleep(0.01)
        state.data["others_first"] = all(map(os.path.exists, names))
    done = state.data["moves"] >= int(state.row.get("moves", 2))
    if done and state.row.get("dir"):
        open(os.path.join(state.row["dir"], f"done{state.index}"), "w").close()
    return f"move {state.data['moves']} seen", 1.0 if done else 0.25, done
'''


@pytest.fixture(scope="module")
def hf_engine(tiny_chat_path):
    from areno.rollout.hf import HFEngine

    return HFEngine(tiny_chat_path, dtype="float32", device="cpu", max_model_len=512)


@pytest.fixture(scope="module")
def tok(tiny_chat_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_path)


def _setup(tok, tmp_path, rows, n):
    env = tmp_path / "env.py"
    env.write_text(ENV)
    texts = [tok.apply_chat_template([{"role": "user", "content": "Guess a number."}], tokenize=False,
                                     add_generation_prompt=True) for _ in rows]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = np.array([t for e in enc for t in e], np.int32)
    off = np.concatenate([[0], np.cumsum([len(e) for e in enc])]).astype(np.int64)
    states = [EnvState(texts[i // n], None, None, rows[i // n], i) for i in range(len(rows) * n)]
    return env, ids, off, states


def test_trajectories_are_the_sampled_tokens_and_observations(hf_engine, tok, tmp_path):
    rows = [{"moves": 3}, {"moves": 2}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=2)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    trace = TracingEngine(hf_engine)
    with EnvPool(str(env), workers=2) as pool:
        out = rollout_multiturn(trace, pool, tok, fmt, ids, off, states, 2,
                                SamplingConfig(max_tokens=6, seed=1), EnvBounds(max_turns=4))
    assert out.turns.tolist() == [3, 3, 2, 2]
    assert out.scored.rewards.tolist() == [1.5, 1.5, 1.25, 1.25]  # summed over the steps
    assert (out.batch.finish_reason == FINISH_STOP).all()
    assert assert_token_in_token_out(trace, out, fmt) == 10
    # the observation is a user turn through the template, between two sampled turns
    text = tok.decode(out.batch.response_tokens(0).tolist())
    assert "<|im_start|>user\nmove 1 seen<|im_end|>\n<|im_start|>assistant\n" in text


def test_turn_and_token_bounds_end_trajectories_with_the_reward_counted(hf_engine, tok, tmp_path):
    rows = [{"moves": 9}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=2)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    with EnvPool(str(env), workers=0) as pool:
        out = rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 2,
                                SamplingConfig(max_tokens=4, seed=2), EnvBounds(max_turns=2, reward="last"))
        assert out.turns.tolist() == [2, 2] and out.turn_limit == 2
        assert (out.batch.finish_reason == FINISH_LENGTH).all()
        assert out.scored.rewards.tolist() == [0.25, 0.25]  # the last step's
        for s in states:
            s.data = {}
        out = rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 2,
                                SamplingConfig(max_tokens=4, seed=2), EnvBounds(max_turns=9, max_tokens=20))
    assert out.token_limit == 2 and (out.batch.response_lengths <= 20).all()
    assert (out.batch.finish_reason == FINISH_LENGTH).all() and (out.scored.rewards > 0).all()


def test_only_a_trajectory_whose_last_turn_was_cut_is_overlong(hf_engine, tok, tmp_path):
    """--max-turns ends both rollouts (finish length); --mask-overlong drops only the
    one whose turns ran into --max-new-tokens, not the one whose turns stopped."""
    env, ids, off, states = _setup(tok, tmp_path, [{"moves": 9}], n=2)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    every_token = tuple(range(len(tok)))  # each turn stops at its first token
    outs = []
    with EnvPool(str(env), workers=0) as pool:
        for stop in (every_token, ()):
            for s in states:
                s.data = {}
            outs.append(rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 2, SamplingConfig(
                max_tokens=4, seed=2, stop_token_ids=stop, ignore_eos=True), EnvBounds(max_turns=2)))
    stopped, cut = outs
    assert stopped.turn_limit == cut.turn_limit == 2
    assert (stopped.batch.finish_reason == FINISH_LENGTH).all() and (cut.batch.finish_reason == FINISH_LENGTH).all()
    assert (stopped.batch.policy_lengths == 2).all() and (cut.batch.policy_lengths == 8).all()
    assert overlong_mask(stopped.batch).tolist() == [False, False]
    assert overlong_mask(cut.batch).tolist() == [True, True]


HUGE_OBSERVATION = '''
def step(state, completion):
    return "x" * 1_000_000, 0.5, False  # one 1 MB word
'''


class CountingFormat(ObservationFormat):
    """The real format; records the length of every text it tokenizes."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.tokenized: list[int] = []

    def tokens(self, observation: str, last_token: int) -> np.ndarray:
        self.tokenized.append(len(observation))
        return super().tokens(observation, last_token)


def test_an_observation_longer_than_the_room_left_ends_its_trajectory_untokenized(hf_engine, tok, tmp_path):
    """A 1 MB observation used to be tokenized first (minutes of BPE on a real
    vocabulary, no output) and only then found too long."""
    _, ids, off, states = _setup(tok, tmp_path, [{}], n=2)
    env = tmp_path / "huge.py"
    env.write_text(HUGE_OBSERVATION)
    fmt = CountingFormat(tok, True, hf_engine.eos_token_ids)
    with EnvPool(str(env), workers=0) as pool:
        out = rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 2,
                                SamplingConfig(max_tokens=4, seed=2), EnvBounds(max_turns=3))
    assert fmt.tokenized == []  # refused from its length alone
    assert out.turns.tolist() == [1, 1] and (out.batch.finish_reason == FINISH_LENGTH).all()
    assert out.scored.rewards.tolist() == [0.5, 0.5]  # the env's reward still counts
    m = out.metrics()
    assert (m["env/token_limit"], m["env/long_observations"]) == (2.0, 2.0)
    assert list(m) == list(ENV_METRICS)


def test_others_advance_while_one_trajectory_waits_on_its_env(hf_engine, tok, tmp_path):
    """--env-schedule eager: trajectory 0's first step returns only once the two others
    have finished all their turns: a driver that waited for every env call of a turn
    would stall here."""
    rows = [{"moves": 3, "wait_for": 2, "dir": str(tmp_path)}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=3)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    with EnvPool(str(env), workers=3, timeout=120) as pool:
        out = rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 3,
                                SamplingConfig(max_tokens=4, seed=3), EnvBounds(max_turns=4, eager=True))
    assert out.turns.tolist() == [3, 3, 3]
    assert states[0].data["others_first"], "the others waited for trajectory 0's env"


SLOW_ODD = '''
import time
def step(state, completion):
    state.data["n"] = state.data.get("n", 0) + 1
    time.sleep(0.05 * (state.index % 2) * (state.data["n"] % 2))  # odd trajectories answer late
    return f"seen {state.data['n']}", 0.5, state.data["n"] >= 3
'''


def test_the_turns_schedule_samples_the_same_whatever_the_env_timing(hf_engine, tok, tmp_path):
    """--env-schedule turns (the default): each generate call holds every trajectory
    whose env has answered, in index order, so the rollout is a function of the
    seed: two runs whose env calls return in different orders sample the same tokens."""
    rows = [{}, {}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=3)
    env.write_text(SLOW_ODD)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    outs = []
    for workers in (1, 3):  # one worker answers in order; three let the fast ones overtake
        fresh = [EnvState(s.prompt, None, None, s.row, s.index) for s in states]
        with EnvPool(str(env), workers=workers, timeout=60) as pool:
            outs.append(rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, fresh, 3,
                                          SamplingConfig(max_tokens=4, seed=9), EnvBounds(max_turns=4)))
    a, b = outs
    for f in ("response_ids", "response_offsets", "response_logprobs", "response_mask", "finish_reason"):
        np.testing.assert_array_equal(getattr(a.batch, f), getattr(b.batch, f), err_msg=f)
    assert a.rounds == b.rounds == 3


class _NewVersionEachCall:
    """The engine, told a new weight version (the same weights) after every
    generate call: each round of turns is sampled by the next version."""

    def __init__(self, engine, first: int) -> None:
        self.engine, self.max_model_len = engine, engine.max_model_len
        self.version = first
        self._state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.update_weights_inflight(self._state.items(), first)

    def generate_stream(self, ids, offsets, n, sampling, min_groups=1):
        yield from self.engine.generate_stream(ids, offsets, n, sampling, min_groups=min_groups)
        self.version += 1
        self.engine.update_weights_inflight(self._state.items(), self.version)


def test_a_trajectory_whose_turns_span_versions_carries_each_tokens_version(hf_engine, tok, tmp_path):
    """Turn k of every trajectory was sampled by version 4 + k: its tokens say so,
    an observation carries its turn's version (no lag counts it), and the
    trajectory's oldest sampled token is its first turn's."""
    from areno.rollout.batch import oldest_version

    rows = [{"moves": 3}, {"moves": 2}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=2)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    engine = _NewVersionEachCall(hf_engine, first=5)
    try:
        with EnvPool(str(env), workers=2) as pool:
            out = rollout_multiturn(engine, pool, tok, fmt, ids, off, states, 2,
                                    SamplingConfig(max_tokens=6, seed=1), EnvBounds(max_turns=4))
    finally:
        hf_engine.weight_version = None
    b = out.batch
    assert b.token_version is not None and b.token_version.dtype == np.int32
    for i in range(b.num_responses):
        lo, hi = b.response_offsets[i], b.response_offsets[i + 1]
        v, m = b.token_version[lo:hi], b.response_mask[lo:hi]
        turn = np.cumsum(np.diff(np.concatenate([[0], m.astype(np.int64)])) == 1)  # 1, 2, ... per sampled run
        assert (v[m == 1] == 4 + turn[m == 1]).all(), (i, v, m)
        assert (v[m == 0] == 4 + turn[m == 0]).all()  # the observation after turn k: version 4 + k
    assert oldest_version(b).tolist() == [5] * b.num_responses


def test_each_group_is_emitted_once_its_trajectories_end_and_the_parts_make_the_rollout(hf_engine, tok, tmp_path):
    """emit (an engine process streaming a multi-turn round, --partial-rollouts'
    first-finished takes): group 0 (one move) ends at its first step and goes out
    alone while group 1 (three moves) still plays; the parts hold every group
    once, merged they are the rollout returned, and their counts and seconds
    (those since the part before) add up to its totals."""
    from areno.rollout.batch import RolloutBatch

    rows = [{"moves": 1}, {"moves": 3}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=2)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    parts = []
    with EnvPool(str(env), workers=2, timeout=60) as pool:
        out = rollout_multiturn(hf_engine, pool, tok, fmt, ids, off, states, 2,
                                SamplingConfig(max_tokens=4, seed=3), EnvBounds(max_turns=4), emit=parts.append)
    assert [p.positions.tolist() for p in parts] == [[0], [1]]
    assert [p.turns.tolist() for p in parts] == [[1, 1], [3, 3]] and out.turns.tolist() == [1, 1, 3, 3]
    merged, _ = RolloutBatch.merge_parts([p.batch for p in parts], [p.positions for p in parts])
    for f in ("prompt_ids", "response_ids", "response_offsets", "response_logprobs", "response_mask",
              "finish_reason", "group_index", "turn_cut"):
        np.testing.assert_array_equal(getattr(merged, f), getattr(out.batch, f), err_msg=f)
    np.testing.assert_array_equal(np.concatenate([p.scored.rewards for p in parts]), out.scored.rewards)
    assert sum(p.rounds for p in parts) == out.rounds == 3
    assert sum(p.generate_s for p in parts) == pytest.approx(out.generate_s)


SLOW_FIRST = '''
import time
def step(state, completion):
    state.data["n"] = state.data.get("n", 0) + 1
    time.sleep(1.0 if state.row.get("slow") else 0.0)
    return f"seen {state.data['n']}", 1.0, state.data["n"] >= 2
'''


def test_a_queued_round_runs_while_the_running_ones_trajectories_wait_on_their_envs(hf_engine, tok, tmp_path):
    """envs/rounds.py, several rounds in one loop over one engine (the multi-turn
    tail fill of --partial-rollouts, fleet/episode_rounds.py): round 0's env
    answers after 1 s a step; round 1, admitted as soon as every trajectory of
    round 0 waits, plays its two turns meanwhile (a worker each: the pool has
    room for both rounds) and ends first; both rollouts are whole (every
    trajectory two turns, its tokens sampled), each streamed part of groups
    goes to its own round, and the engine's waits count once, on the round
    running."""
    from areno.envs.driver import driver
    from areno.envs.rounds import run_rounds

    rows0, rows1 = [{"slow": True}, {"slow": True}], [{}, {}]
    env, ids, off, states0 = _setup(tok, tmp_path, rows0, n=2)
    _, _, _, states1 = _setup(tok, tmp_path, rows1, n=2)
    env.write_text(SLOW_FIRST)
    fmt = ObservationFormat(tok, True, hf_engine.eos_token_ids)
    s = SamplingConfig(max_tokens=4, seed=3)
    parts: dict[int, list] = {0: [], 1: []}
    ended: list[tuple[int, object]] = []
    with EnvPool(str(env), workers=8, timeout=60) as pool:
        pool.warm()  # eight workers up: the timing below is the env's, not a worker's start-up

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
    assert slow.engine_idle_s > 0.8  # the waits on round 0's envs once round 1 had ended
    assert dict(ended)[1].engine_idle_s < 0.5
