"""Multi-turn trajectories halted mid-rollout (Ctrl-C under --partial-rollouts)
and continued on resume (envs/halted.py, envs/resume.py): the driver ends each
with its tokens and books, and a driver of its own runs it to the end it
would have had, none of its tokens lost or sampled twice."""

from __future__ import annotations

import numpy as np
import pytest

from areno.envs.driver import EnvBounds, EpisodeSpec, observation_format, rollout_multiturn
from areno.envs.halted import MID_TURN, NEXT_TURN
from areno.envs.pool import EnvPool
from areno.envs.resume import continue_episodes, halted_episodes
from areno.rollout.batch import FINISH_ABORT, FINISH_STOP, decode_one
from areno.rollout.engine import SamplingConfig
from test_env_driver import _setup, tok  # noqa: F401  (a fixture)

# Three moves a trajectory (reward 0.25, 0.25, 1.0); each observation names the
# length of the whole turn the environment was given.
ENV = '''
def reset(state):
    state.data["moves"] = 0
def step(state, completion):
    state.data["moves"] += 1
    done = state.data["moves"] >= 3
    return f"len {len(completion)}", 1.0 if done else 0.25, done
'''


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request, tiny_chat_path):
    if request.param == "hf":
        from areno.rollout.hf import HFEngine

        eng = HFEngine(tiny_chat_path, dtype="float32", device="cpu", max_model_len=512)
    else:
        from areno.rollout.vllm import VLLMEngine

        eng = VLLMEngine(tiny_chat_path, dtype="float32", seed=0, max_model_len=512,
                         kv_cache_memory_bytes=32 << 20)
    yield eng
    eng.shutdown()


class HaltAt:
    """The real engine; from its `call`-th generate call on, its step hook halts
    it at decode step `step` (as fleet/inflight_loads.py's halt does)."""

    def __init__(self, engine, call: int, step: int) -> None:
        self.engine, self.call, self.step, self.calls = engine, call, step, 0
        self.max_model_len = engine.max_model_len

    def hook(self, steps: int) -> None:
        if self.calls >= self.call and steps >= self.step:
            self.engine.halt = True

    def generate_stream(self, ids, offsets, n, sampling, min_groups=1):
        self.calls += 1
        self.engine.step_hook = self.hook
        yield from self.engine.generate_stream(ids, offsets, n, sampling, min_groups=min_groups)


def turns_of(batch, i: int) -> list[tuple[int, np.ndarray]]:
    """Response i as its pieces: (mask value, tokens)."""
    a, b = batch.response_offsets[i], batch.response_offsets[i + 1]
    ids, mask = batch.response_ids[a:b], batch.response_mask[a:b]
    cuts = np.flatnonzero(np.diff(mask)) + 1
    return [(int(m[0]), t) for m, t in zip(np.split(mask, cuts), np.split(ids, cuts))]


@pytest.mark.parametrize("halt_step", [2, 1])
def test_a_halted_rollout_continues_to_the_end_it_would_have_had(engine, tok, tmp_path,  # noqa: F811
                                                                  tiny_chat_path, halt_step):
    """Four trajectories of three moves, the engine halted in their second turn
    at decode step `halt_step` (and from there on at each turn's first): each
    ends "abort" with its books; continued (the halt lifted, version 1), each
    ends as an uninterrupted run would (three moves, reward 1.5), its saved
    tokens, log-probs and versions (0) first, the environment given each cut
    turn's whole text."""
    rows = [{}, {}]
    env, ids, off, states = _setup(tok, tmp_path, rows, n=2)
    env.write_text(ENV)
    fmt = observation_format(tok, True)  # as the run makes it
    sampling, bounds = SamplingConfig(max_tokens=6, seed=1), EnvBounds(max_turns=4)
    engine.weight_version = 0
    try:
        with EnvPool(str(env), workers=2) as pool:  # halted in its second turn
            out = rollout_multiturn(HaltAt(engine, 2, halt_step), pool, tok, fmt, ids, off, states, 2,
                                    sampling, bounds)
    finally:
        engine.step_hook, engine.halt = None, False
    saved, scored = out.batch, out.scored
    which = halted_episodes(scored)
    assert which.tolist() == [0, 1, 2, 3] and (saved.finish_reason == FINISH_ABORT).all()
    records = [scored.payloads[i] for i in which]
    assert {r.kind for r in records} <= {MID_TURN, NEXT_TURN} and MID_TURN in {r.kind for r in records}
    for i, r in enumerate(records):
        assert r.state.data["moves"] == 1 and scored.rewards[i] == 0.25  # one step answered
        assert r.turns == 1 + (r.kind == MID_TURN)
        if r.kind == MID_TURN:
            assert 1 <= r.turn_tokens <= halt_step and turns_of(saved, i)[-1][1].size == r.turn_tokens

    spec = EpisodeSpec(str(env), 2, 30.0, "fail", str(tiny_chat_path), True, bounds)
    assert_continued(engine, spec, saved, scored, sampling, tok)


def assert_continued(engine, spec, saved, scored, sampling, tokenizer) -> None:
    """The four halted trajectories of `saved` (their tokens of version 0), continued
    by `engine` at version 1, each end as an uninterrupted run would: three
    moves, reward 1.5, every saved token, log-prob and version first, each new
    sampled token of version 1, the environment given each turn's whole text."""
    ((whole, rewards),) = continue_episodes(engine, spec, [(saved, scored, sampling, 0)], 1)
    assert (whole.finish_reason == FINISH_STOP).all() and rewards.rewards.tolist() == [1.5] * 4
    for i in range(4):
        a, b = saved.response_offsets[i], saved.response_offsets[i + 1]
        c = whole.response_offsets[i]
        np.testing.assert_array_equal(whole.response_ids[c:c + b - a], saved.response_ids[a:b])
        np.testing.assert_array_equal(whole.response_logprobs[c:c + b - a], saved.response_logprobs[a:b])
        assert set(whole.token_version[c:c + b - a].tolist()) == ({0} if b > a else set())
        new = slice(c + b - a, whole.response_offsets[i + 1])  # an observation: its turn's version
        assert set(whole.token_version[new][whole.response_mask[new] == 1].tolist()) == {1}
        pieces = turns_of(whole, i)
        assert [m for m, _ in pieces] == [1, 0, 1, 0, 1]  # three turns, the cut one whole again
        for (_, turn), (_, obs) in zip(pieces[0::2], pieces[1::2]):  # the env saw each whole turn
            assert f"len {len(decode_one(tokenizer, turn))}" in decode_one(tokenizer, obs)


# ENV with a gate: the call that makes move AT (0: the reset) waits while the file HOLD exists.
HELD_ENV = """
import os, time
HOLD, AT = {hold!r}, {at}
def _held():
    t_end = time.monotonic() + 60.0
    while os.path.exists(HOLD) and time.monotonic() < t_end:
        time.sleep(0.02)
def reset(state):
    if AT == 0:
        _held()
    state.data["moves"] = 0
def step(state, completion):
    if state.data["moves"] + 1 == AT:
        _held()
    state.data["moves"] += 1
    done = state.data["moves"] >= 3
    return f"len {{len(completion)}}", 1.0 if done else 0.25, done
"""


@pytest.mark.parametrize("at", [2, 0], ids=["step", "reset"])
def test_a_halt_does_not_wait_for_the_environment_and_resume_asks_its_call_again(
        engine, tok, tmp_path, tiny_chat_path, at):  # noqa: F811
    """The rounds' loop of an engine process (envs/rounds.py), its four trajectories
    all waiting on held environment calls (their second step, or their reset)
    when the run starts saving: the loop ends them there, the calls still out
    (the hold is lifted only after), each with its books: the step due with the
    turn's text, or the reset due. Continued, each runs to the end an
    uninterrupted run has, its due call asked again."""
    from areno.envs.driver import driver
    from areno.envs.halted import RESET_DUE, STEP_DUE
    from areno.envs.rounds import run_rounds

    hold = tmp_path / "hold"
    hold.touch()
    env, ids, off, states = _setup(tok, tmp_path, [{}, {}], n=2)
    env.write_text(HELD_ENV.format(hold=str(hold), at=at))
    sampling, bounds = SamplingConfig(max_tokens=6, seed=1), EnvBounds(max_turns=4)
    engine.weight_version = 0
    outs = []
    with EnvPool(str(env), workers=4) as pool:
        d = driver(engine, pool, tok, observation_format(tok, True), ids, off, states, 2, sampling, bounds)
        run_rounds(d, lambda: None, lambda k, out: outs.append(out),
                   halting=lambda: len(d.pending) == 4 and (d.traj.turns == at).all())
        assert hold.exists()  # every call still held: none was waited for
        hold.unlink()
    ((saved, scored),) = [(o.batch, o.scored) for o in outs]
    assert halted_episodes(scored).tolist() == [0, 1, 2, 3] and (saved.finish_reason == FINISH_ABORT).all()
    for i, r in enumerate(scored.payloads):
        a, b = saved.response_offsets[i], saved.response_offsets[i + 1]
        assert (r.kind, r.turns, r.turn_tokens) == ((STEP_DUE, 2, 0) if at else (RESET_DUE, 0, 0))
        assert r.state.data == ({"moves": 1} if at else {}) and scored.rewards[i] == (0.25 if at else 0.0)
        if at:  # the text of its second turn, the last tokens it sampled
            assert r.completion == decode_one(tok, turns_of(saved, i)[-1][1])
        else:
            assert r.completion is None and b == a

    spec = EpisodeSpec(str(env), 2, 30.0, "fail", str(tiny_chat_path), True, bounds)
    assert_continued(engine, spec, saved, scored, sampling, tok)


def test_a_ctrl_c_halts_multi_turn_rounds_and_the_resumed_run_continues_every_trajectory(
        tmp_path, areno_cache, monkeypatch):
    """Split placement, K = 1, partial rollouts, an environment of three moves on
    the workers of the engine process (in-process: --reward-workers 0, so round 2
    runs after round 1 as its own command), the engine gated (halt_gate_hooks.py)
    so that round 2 is sampling a turn, at decode step HALT_STEP, when a SIGINT
    comes right after step 1's update. The run halts it instead of waiting, saves
    its trajectories with their books, exits 130. Resumed, every saved token,
    log-prob and version trains first in its trajectory, each halted one run on
    by version 1 to the end of its three moves."""
    from areno.inflight_file import load_inflight
    from halt_gate_hooks import HALT_STEP
    from test_halt_resume import ARGS, halted_run, saved_responses, trained_on_resume

    env = tmp_path / "env.py"
    env.write_text(ENV)
    args = [*ARGS, "--env-path", str(env), "--max-turns", "4", "--reward-workers", "0"]
    res, ckpt = halted_run(tmp_path, areno_cache, monkeypatch, args)
    assert res.returncode == 130, res.stderr[-3000:]
    assert "their environments' states" in res.stdout, res.stdout[-3000:]
    saved = saved_responses(ckpt)
    records = [p for cur in load_inflight(ckpt) for p in (cur.saved[1].payloads or []) if p is not None]
    assert any(r.kind == MID_TURN and 1 <= r.turn_tokens <= HALT_STEP for r in records)
    halted = [s for group in saved.values() for s in group if s[3] == FINISH_ABORT]
    assert len(halted) == len(records) > 0

    _, got = trained_on_resume(tmp_path, areno_cache, monkeypatch, args, ckpt)
    assert set(saved) <= set(got)  # every saved group trained
    continued = 0
    for prompt, group in saved.items():
        for (ids, lp, ver, finish), (ids2, lp2, ver2, finish2, reward) in zip(group, got[prompt], strict=True):
            n = ids.size
            np.testing.assert_array_equal(ids2[:n], ids)
            np.testing.assert_array_equal(lp2[:n], lp)
            np.testing.assert_array_equal(ver2[:n], ver)
            if finish == FINISH_ABORT:
                assert finish2 == FINISH_STOP and reward == 1.5 and set(ver2[n:].tolist()) == {1}
                continued += ids2.size - n
            else:
                assert ids2.size == n and finish2 == finish
    assert continued > 0


# ENV whose last trajectory of a round (ARGS: 4 prompts x 4: index 15) holds
# its second move while the file HOLD exists (30 s at most).
LAST_HELD_ENV = """
import os, time
HOLD = {hold!r}
def reset(state):
    state.data["moves"] = 0
def step(state, completion):
    if state.index == 15 and state.data["moves"] == 1:
        t_end = time.monotonic() + 30.0
        while os.path.exists(HOLD) and time.monotonic() < t_end:
            time.sleep(0.02)
    state.data["moves"] += 1
    done = state.data["moves"] >= 3
    return f"len {{len(completion)}}", 1.0 if done else 0.25, done
"""


@pytest.mark.faults
def test_a_ctrl_c_does_not_wait_for_environment_calls_out_and_the_resume_asks_them_again(
        tmp_path, areno_cache, monkeypatch):
    """Split placement, K = 1, an environment on 4 workers of the engine process
    whose last trajectory of every round holds its second move (until the test
    lifts the hold, after the run): step 1 trains the first 4 groups to finish,
    and a SIGINT comes right after its update. Waiting for the held calls would
    take 30 s, and they would answer; the run halts the waiting trajectories
    instead (the held ones, and any whose call is out), saves them with their
    steps due and exits 130. Resumed, the due steps are asked again and every
    halted trajectory runs to the end of its three moves, its saved tokens
    first."""
    from areno.envs.halted import STEP_DUE
    from areno.inflight_file import load_inflight
    from test_halt_resume import ARGS, halted_run, saved_responses, trained_on_resume

    env, hold = tmp_path / "env.py", tmp_path / "hold"
    env.write_text(LAST_HELD_ENV.format(hold=str(hold)))
    hold.touch()
    args = [*ARGS, "--env-path", str(env), "--max-turns", "4", "--reward-workers", "4", "--reward-timeout", "60"]
    try:
        res, ckpt = halted_run(tmp_path, areno_cache, monkeypatch, args, gated=False)
    finally:
        hold.unlink()
    assert res.returncode == 130, res.stderr[-3000:]
    records = [p for cur in load_inflight(ckpt) for p in (cur.saved[1].payloads or []) if p is not None]
    due = [r for r in records if r.kind == STEP_DUE]
    assert all(r.completion is not None and r.state.data["moves"] == r.turns - 1 for r in due)
    assert any(r.state.index == 15 and r.state.data["moves"] == 1 for r in due)  # a held call, not waited for

    saved = saved_responses(ckpt)
    _, got = trained_on_resume(tmp_path, areno_cache, monkeypatch, args, ckpt)
    assert set(saved) <= set(got)
    for prompt, group in saved.items():
        for (ids, lp, ver, finish), (ids2, lp2, ver2, finish2, reward) in zip(group, got[prompt], strict=True):
            np.testing.assert_array_equal(ids2[:ids.size], ids)
            np.testing.assert_array_equal(lp2[:ids.size], lp)
            if finish == FINISH_ABORT:  # continued by version 1 (an observation: its turn's version)
                assert finish2 == FINISH_STOP and reward == 1.5 and 1 in set(ver2[ids.size:].tolist())
