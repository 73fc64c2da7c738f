"""Environment calls run on the reward pool's workers: a hung or raising
environment gets the reward plugin's policies (timeout kill of the whole
process group, fail / zero / skip, one-line errors) and leaves no process."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from areno.envs.plugin import EnvState, load_env_plugin
from areno.envs.pool import EnvPool
from areno.errors import UserError
from areno.rewards import RewardError

ENV = '''
import os, subprocess, sys, time
def reset(state):
    state.data["n"] = 0
def step(state, completion):
    state.data["n"] += 1
    if completion == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open(os.environ["CHILD_PID_FILE"], "w").write(str(child.pid))
        time.sleep(300)
    if completion == "slow":
        time.sleep(1.0)
    if completion == "raise":
        raise ValueError("no such move")
    if completion == "bad":
        return "only an observation"
    return f"seen {completion}", 0.25 * state.data["n"], state.data["n"] >= 2
'''


@pytest.fixture
def env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))
    p = tmp_path / "env.py"
    p.write_text(ENV)
    return p


def _state(i: int = 0) -> EnvState:
    return EnvState(prompt="p", answer=None, solutions=None, row={}, index=i)


def _call(pool: EnvPool, state: EnvState, completion: str | None):
    t = pool.submit(state, completion)
    assert pool.wait_any([t], timeout=30) == [t]
    return pool.result(t)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_state_data_travels_with_the_trajectory_between_calls(env_file):
    with EnvPool(str(env_file), workers=2, timeout=5) as pool:
        s = _state()
        s.data = _call(pool, s, None).reply.data
        out = _call(pool, s, "a")
        assert (out.reply.observation, out.reward, out.reply.done) == ("seen a", 0.25, False)
        s.data = out.reply.data
        out = _call(pool, s, "b")
        assert (out.reward, out.reply.done) == (0.5, True)


def test_wait_any_sleeps_until_a_call_finishes_instead_of_polling(env_file):
    """A 1 s env step: wait_any returns as it finishes, having spent next to no CPU
    in this thread meanwhile (a 1 ms poll spends ~1000 wake-ups); timeout 0 and a
    short timeout return what is done, here nothing."""
    with EnvPool(str(env_file), workers=1, timeout=30) as pool:
        pool.warm()
        s = _state()
        s.data = _call(pool, s, None).reply.data
        t0 = time.monotonic()
        slow = pool.submit(s, "slow")
        assert pool.wait_any([slow], timeout=0.0) == []
        assert pool.wait_any([slow], timeout=0.2) == [] and time.monotonic() - t0 >= 0.2
        cpu0 = time.thread_time()
        assert pool.wait_any([slow]) == [slow]
        cpu, wall = time.thread_time() - cpu0, time.monotonic() - t0
        assert 1.0 <= wall < 2.0, wall
        assert cpu < 0.005, f"{cpu * 1e3:.1f} ms of CPU waiting {wall:.2f} s"
        assert pool.result(slow).reward == 0.25
        assert pool.wait_any([]) == []


@pytest.mark.faults
@pytest.mark.parametrize("policy", ["zero", "skip"])
def test_a_hung_env_is_killed_with_its_children_and_gets_the_policy(env_file, tmp_path, policy):
    with EnvPool(str(env_file), workers=1, timeout=1.0, on_error=policy) as pool:
        s = _state(7)
        s.data = {"n": 0}
        t0 = time.monotonic()
        out = _call(pool, s, "hang")
        assert time.monotonic() - t0 < 8
        assert out.reply is None and out.counts.timeouts == 1
        assert (out.reward, out.valid) == ((0.0, True) if policy == "zero" else (out.reward, False))
        assert "sample 7" in out.messages[0] and "timed out" in out.messages[0]
        child = int((tmp_path / "child.pid").read_text())
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the environment's child outlived its killed worker"
        # the respawned worker takes the next call
        s.data = {"n": 0}
        assert _call(pool, s, "x").reply.observation == "seen x"
    assert not [p for p in mp.active_children() if p.name == "areno-reward-worker"]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_env_fails_in_one_line_or_is_counted(env_file, workers):
    with EnvPool(str(env_file), workers=workers, timeout=5, on_error="fail") as pool:
        s = _state(3)
        s.data = {"n": 0}
        with pytest.raises(RewardError) as e:
            _call(pool, s, "raise")
        msg = str(e.value)
        assert "\n" not in msg and "environment" in msg and "sample 3" in msg
        assert "ValueError: no such move" in msg and "env.py:" in msg
    with EnvPool(str(env_file), workers=workers, timeout=5, on_error="zero") as pool:
        s.data = {"n": 0}
        out = _call(pool, s, "bad")
        assert out.counts.errors == 1 and out.reward == 0.0 and out.reply is None
        assert "not (observation: str, reward: float, done: bool)" in out.messages[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_unpicklable_state_data_is_the_plugins_error_in_one_line(tmp_path, workers):
    """It used to kill the worker on the way back: "worker process died (exit code 1)"."""
    (tmp_path / "env.py").write_text("import threading\n"
                                     "def step(state, completion):\n"
                                     "    state.data['lock'] = threading.Lock()\n"
                                     "    return 'o', 1.0, False\n")
    with EnvPool(str(tmp_path / "env.py"), workers=workers, timeout=5, on_error="fail") as pool:
        with pytest.raises(RewardError) as e:
            _call(pool, _state(2), "c")
    msg = str(e.value)
    assert "sample 2" in msg and "step left state.data that cannot be pickled" in msg, msg
    assert "cannot pickle '_thread.lock' object" in msg and "died" not in msg, msg


def test_an_env_without_step_or_file_is_a_user_error(tmp_path):
    (tmp_path / "nostep.py").write_text("def reset(state):\n    pass\n")
    with pytest.raises(UserError, match="defines no step"):
        load_env_plugin(str(tmp_path / "nostep.py"))
    with pytest.raises(UserError, match="environment"):
        load_env_plugin(str(tmp_path / "missing.py"))
    (tmp_path / "async_env.py").write_text("async def step(state, c):\n    return 'o', 1.0, True\n")
    assert load_env_plugin(str(tmp_path / "async_env.py")).is_async
    with EnvPool(str(tmp_path / "async_env.py"), workers=0) as pool:
        assert _call(pool, _state(), "c").reward == 1.0
