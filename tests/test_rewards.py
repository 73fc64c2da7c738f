"""areno.rewards: plugin loading, fault-isolated parallel scoring, on_error policies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from arenobench.lib import child_env
from areno.errors import UserError
from areno.rewards import (
    MAX_CHUNK,
    RewardCounts,
    RewardError,
    RewardRecord,
    RewardResult,
    RewardScorer,
    load_reward_plugin,
)

TIMEOUT = 1.0

# One plugin whose behaviour is picked by the completion text.
MULTI = """
import math, os, sys, time

def reward_fn(record):
    c = record.completion
    if c.startswith("ok:"):
        return float(c[3:])
    if c == "raise":
        raise ValueError("bad sample")
    if c == "hang":
        time.sleep(1000)
    if c == "nan":
        return math.nan
    if c == "inf":
        return -math.inf
    if c == "kbint":
        raise KeyboardInterrupt("the plugin's own")
    if c.startswith("big:"):
        return float(c[4:])
    if c == "exit":
        os._exit(3)
    if c == "sysexit":
        sys.exit(4)
    if c == "str":
        return "1.0"
    if c == "segv":
        import ctypes
        ctypes.string_at(0)
    if c == "numpy":
        import numpy
        return numpy.float32(0.25)
    return 0.5
"""

# completion -> (failure kind, text the one-line error must contain)
BAD = {
    "raise": ("errors", r"raised ValueError: bad sample \(multi.py:9\)"),
    "hang": ("timeouts", "timed out after 1 s"),
    "nan": ("nan", "returned nan"),
    "inf": ("nan", "returned -inf"),
    "kbint": ("errors", "raised KeyboardInterrupt: the plugin's own"),
    "big:1e300": ("nan", r"returned 1e\+300, beyond the limit of \+-1e\+06"),
    "big:-1e38": ("nan", r"returned -1e\+38, beyond the limit of \+-1e\+06"),
    "exit": ("worker_crashes", r"worker process died \(exit code 3\)"),
    "sysexit": ("errors", "raised SystemExit: 4"),
    "str": ("errors", "returned str '1.0', not a number"),
    "segv": ("worker_crashes", r"worker process died \(killed by SIGSEGV\)"),
}


def rec(completion: str, index: int = 0, **kw) -> RewardRecord:
    fields = dict(prompt="p", completion=completion, answer=None, solutions=None, row={"id": index},
                  num_tokens=len(completion), finish_reason="stop", index=index)
    fields.update(kw)
    return RewardRecord(**fields)


def recs(completions, start: int = 0) -> list[RewardRecord]:
    return [rec(c, start + i) for i, c in enumerate(completions)]


def write(tmp_path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> str:
    return write(tmp_path_factory.mktemp("plugins"), "multi.py", MULTI)


@pytest.fixture(scope="module")
def scorers(multi):
    """One warm scorer per policy, shared by the tests of this module."""
    made: dict[str, RewardScorer] = {}

    def get(policy: str) -> RewardScorer:
        if policy not in made:
            made[policy] = RewardScorer(multi, workers=2, timeout=TIMEOUT, on_error=policy)
        return made[policy]

    yield get
    for s in made.values():
        s.close()


# -- plugin validation ------------------------------------------------------------


@pytest.mark.parametrize(
    "name, source, message",
    [
        ("syntax.py", "def reward_fn(r)\n    return 1\n", r"syntax.py: syntax error at line 1"),
        ("imports.py", "import not_a_module_xyz\n", r"imports.py failed to import: ModuleNotFoundError.*\(imports.py:1\)"),
        ("raises.py", "x = 1\nraise RuntimeError('boom')\n", r"raises.py failed to import: RuntimeError: boom \(raises.py:2\)"),
        ("exits.py", "import sys\nsys.exit(2)\n", r"exits.py failed to import: SystemExit: 2"),
        ("empty.py", "def score(r):\n    return 1\n", r"empty.py: defines neither reward_fn\(record\)"),
        ("notfn.py", "reward_fn = 3\n", r"notfn.py: 'reward_fn' is a int, not a function"),
        ("plugin.txt", "def reward_fn(r):\n    return 1\n", r"must be a Python file ending in .py"),
    ],
)
def test_bad_plugins_are_user_errors_naming_the_file(tmp_path, name, source, message):
    path = write(tmp_path, name, source)
    with pytest.raises(UserError, match=message):
        load_reward_plugin(path)
    with pytest.raises(UserError, match=message):
        RewardScorer(path, workers=2)  # fails before any worker starts


def test_missing_plugin_file_and_bad_settings_are_user_errors(tmp_path, multi):
    with pytest.raises(UserError, match=r"plugin not found: .*nope.py"):
        load_reward_plugin(str(tmp_path / "nope.py"))
    with pytest.raises(UserError, match="on_error must be one of fail, zero, skip; got 'ignore'"):
        RewardScorer(multi, on_error="ignore")
    with pytest.raises(UserError, match="timeout > 0"):
        RewardScorer(multi, timeout=0)


def test_batch_fn_is_preferred_and_async_is_detected(tmp_path):
    p = load_reward_plugin(write(tmp_path, "b.py", """
        def reward_fn(r): return 0.0
        async def reward_fn_batch(rs): return [1.0] * len(rs)
    """))
    assert p.batch and p.is_async and p.fn.__name__ == "reward_fn_batch"


# -- scoring in workers ------------------------------------------------------------


def test_good_rewards_in_order_and_numbers_of_any_real_type(scorers):
    s = scorers("fail")
    comps = [f"ok:{i}" for i in range(40)] + ["numpy", "other"]
    r = s.score(recs(comps))
    assert r.rewards.dtype == np.float32 and r.valid.dtype == bool
    np.testing.assert_array_equal(r.rewards, np.r_[np.arange(40), 0.25, 0.5].astype(np.float32))
    assert r.valid.all() and r.counts == RewardCounts() and r.messages == ()


# Only the hang has a clock to keep; the other kinds share the workers' cores.
@pytest.mark.parametrize("bad", [pytest.param(b, marks=pytest.mark.alone) if b == "hang" else b for b in sorted(BAD)])
def test_fail_policy_raises_one_line_naming_the_sample_and_keeps_working(scorers, bad):
    s = scorers("fail")
    s.score(recs(["ok:1"] * 4))  # warm: workers up
    kind, text = BAD[bad]
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=f"multi.py: sample 7: {text}") as e:
        s.score(recs(["ok:1"] * 5 + ["ok:2", "ok:3", bad, "ok:4"]))
    elapsed = time.monotonic() - t0
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "on_error 'fail'" in str(e.value) and "--on-reward-error" not in str(e.value)
    if bad == "hang":  # killed within ~timeout + 1 s
        assert elapsed < TIMEOUT + 1.0, elapsed
    r = s.score(recs(["ok:5", "ok:6"]))  # workers respawned as needed
    assert r.rewards.tolist() == [5.0, 6.0]


MIXED = ["ok:1", "raise", "nan", "inf", "exit", "ok:2", "sysexit", "str", "hang", "segv", "ok:3"]
EXPECTED = RewardCounts(errors=3, timeouts=1, nan=2, worker_crashes=2)


@pytest.mark.alone
def test_zero_policy_zeroes_and_counts_every_failure_kind(scorers):
    t0 = time.monotonic()
    r = scorers("zero").score(recs(MIXED, start=100))
    assert time.monotonic() - t0 < TIMEOUT + 5.0  # incl. worker start and respawns
    good = np.array([c.startswith("ok:") for c in MIXED])
    assert r.valid.all()
    assert r.rewards[good].tolist() == [1.0, 2.0, 3.0] and (r.rewards[~good] == 0).all()
    assert r.counts == RewardCounts(**{**EXPECTED.__dict__, "zeroed": 8})
    assert len(r.messages) == 5 and all(m.startswith("sample 1") for m in r.messages)


def test_skip_policy_marks_failures_invalid_with_nan_rewards(scorers):
    r = scorers("skip").score(recs(MIXED))
    good = np.array([c.startswith("ok:") for c in MIXED])
    np.testing.assert_array_equal(r.valid, good)
    assert r.rewards[good].tolist() == [1.0, 2.0, 3.0] and np.isnan(r.rewards[~good]).all()
    assert r.counts == RewardCounts(**{**EXPECTED.__dict__, "skipped": 8})
    assert r.counts.failures == 8


@pytest.mark.alone
def test_hung_sample_is_killed_within_timeout_and_its_chunk_continues(scorers):
    s = scorers("skip")
    s.score(recs(["ok:0"] * 2))
    before = s._book.seq
    comps = [f"ok:{i}" for i in range(40)]
    comps[1] = "hang"  # in the first chunk of 5 (40 samples / (2 workers x 4))
    t0 = time.monotonic()
    r = s.score(recs(comps))
    assert time.monotonic() - t0 < TIMEOUT + 1.0
    assert r.counts.timeouts == 1 and r.valid.sum() == 39 and not r.valid[1]
    assert r.rewards[r.valid].tolist() == [0.0] + [float(i) for i in range(2, 40)]
    assert s._book.seq - before > 8  # the 3 samples after the hang went out again


def test_thousands_of_samples_go_out_in_chunks(scorers):
    s = scorers("fail")
    before = s._book.seq
    n = 3000
    r = s.score([rec(f"ok:{i % 7}", i) for i in range(n)])
    assert r.rewards.sum() == sum(i % 7 for i in range(n))
    assert s._book.seq - before == -(-n // MAX_CHUNK)  # one message per chunk, not per sample


def test_submit_collect_overlaps_and_keeps_order(scorers):
    s = scorers("skip")
    t1 = s.submit(recs(["ok:1", "ok:2"]))
    t2 = s.submit(recs(["ok:3", "nan", "ok:4"]))
    r2 = s.collect(t2)  # any order
    assert r2.rewards[[0, 2]].tolist() == [3.0, 4.0] and r2.counts.nan == 1
    assert s.collect(t1).rewards.tolist() == [1.0, 2.0]
    a = s.submit(recs(["ok:5"]))
    s.submit(recs(["ok:6", "ok:7"]))
    deadline = time.monotonic() + 10
    while not s.ready(a) and time.monotonic() < deadline:
        time.sleep(0.01)
    both = s.collect()  # everything outstanding, in submit order
    assert both.rewards.tolist() == [5.0, 6.0, 7.0]
    assert s.collect().rewards.size == 0
    assert s.score([]).rewards.size == 0


def test_async_reward_fn_in_workers_and_in_process(tmp_path):
    path = write(tmp_path, "a.py", """
        import asyncio
        async def reward_fn(record):
            await asyncio.sleep(0.001)
            return float(len(record.completion))
    """)
    for workers in (1, 0):
        with RewardScorer(path, workers=workers) as s:
            assert s.score(recs(["a", "bbb"])).rewards.tolist() == [1.0, 3.0]


@pytest.mark.alone
def test_batch_plugin_gets_chunks_and_timeout_scales_with_chunk_size(tmp_path):
    path = write(tmp_path, "batch.py", """
        import time
        def reward_fn_batch(records):
            if any(r.completion == "hang" for r in records):
                time.sleep(1000)
            if any(r.completion == "short" for r in records):
                return [1.0]
            time.sleep(0.15 * len(records))  # 0.6 s per chunk of 4: over 0.5 s, under 4 x 0.5 s
            return [float(len(records))] * len(records)
    """)
    with RewardScorer(path, workers=1, timeout=0.5, on_error="skip", chunk_size=4) as s:
        r = s.score(recs(["x"] * 6))
        assert r.rewards.tolist() == [4.0] * 4 + [2.0] * 2  # one call per chunk
        assert r.counts == RewardCounts()
        t0 = time.monotonic()
        r = s.score(recs(["x", "hang", "x", "x", "x"]))
        assert 2.0 <= time.monotonic() - t0 < 2.0 + 1.5  # 4 records x 0.5 s
        assert r.valid.tolist() == [False] * 4 + [True] and r.counts.timeouts == 4
        r = s.score(recs(["short", "x"]))
        assert r.counts.errors == 2
        assert "reward_fn_batch returned list of length 1 for 2 records" in r.messages[0]


def test_async_batch_plugin_in_process(tmp_path):
    path = write(tmp_path, "ab.py", """
        async def reward_fn_batch(records):
            return [r.index * 1.0 for r in records]
    """)
    with RewardScorer(path, workers=0) as s:
        assert s.score(recs(["a", "b", "c"], start=3)).rewards.tolist() == [3.0, 4.0, 5.0]


def test_in_process_scoring_applies_the_same_policies(tmp_path):
    path = write(tmp_path, "p.py", """
        import sys
        def reward_fn(record):
            if record.completion == "raise":
                raise KeyError("k")
            if record.completion == "sysexit":
                sys.exit(1)
            return 1.0
    """)
    with RewardScorer(path, workers=0, on_error="zero") as s:
        r = s.score(recs(["ok", "raise", "sysexit", "ok"]))
        assert r.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and r.counts.errors == 2
    with RewardScorer(path, workers=0, on_error="fail") as s:
        with pytest.raises(RewardError, match=r"sample 1: raised KeyError: 'k' \(p.py:5\)"):
            s.score(recs(["ok", "raise"]))


def test_plugin_that_cannot_load_in_workers_stops_scoring_with_a_clear_error(tmp_path):
    path = write(tmp_path, "w.py", """
        import multiprocessing
        if multiprocessing.parent_process() is not None:
            raise ImportError("only works in the trainer")
        def reward_fn(record):
            return 1.0
    """)
    with RewardScorer(path, workers=1) as s:
        with pytest.raises(RewardError, match="failed to load in a worker process.*only works in the trainer"):
            s.score(recs(["a"]))


def test_close_ends_every_worker_and_refuses_more_work(multi):
    s = RewardScorer(multi, workers=2, timeout=TIMEOUT, on_error="skip")
    t = s.submit(recs(["hang", "ok:1"]))  # a worker is busy in a hung sample
    time.sleep(0.3)
    procs = [w.proc for w in s._pool]
    s.close()
    assert procs and not any(p.is_alive() for p in procs)
    with pytest.raises(RewardError, match="was closed"):
        s.collect(t)
    with pytest.raises(RuntimeError, match="after close"):
        s.submit(recs(["ok:1"]))
    s.close()  # idempotent


def test_workers_die_with_a_killed_trainer(multi, tmp_path):
    # The trainer process is SIGKILLed (no atexit); its workers, one stuck in a
    # hung plugin, must not outlive it.
    script = write(tmp_path, "trainer.py", f"""
        import sys, time
        from areno.rewards import RewardScorer, RewardRecord
        if __name__ == "__main__":  # spawned workers import this file too
            s = RewardScorer({multi!r}, workers=2, timeout=1000)
            r = RewardRecord("p", "hang", None, None, {{}}, 1, "stop", 0)
            s.submit([r, r])
            while not (s._pool and all(w.ready and w.busy for w in s._pool)):
                time.sleep(0.05)
            time.sleep(0.2)
            print(" ".join(str(w.proc.pid) for w in s._pool), flush=True)
            time.sleep(1000)
    """)
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True, env=child_env())
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        assert not alive
    finally:
        proc.kill()
        for pid in pids:  # only if the test failed: do not leak them
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


STARTS_A_CHILD = """
import os, subprocess, sys, time
def reward_fn(record):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.environ["CHILD_PID_FILE"], "a") as f:
        f.write(f"{child.pid}\\n")
    if record.completion == "hang":
        time.sleep(1000)
    return 0.0
"""


def _children_started(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.is_file() else []


def _wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def test_what_an_in_process_plugin_starts_dies_when_the_scorer_closes(tmp_path, monkeypatch):
    """--reward-workers 0: such children used to outlive every run."""
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "pids"))
    plugin = write(tmp_path, "starts.py", STARTS_A_CHILD)
    with RewardScorer(plugin, workers=0) as s:
        s.score(recs(["ok"]))
        children = _children_started(tmp_path / "pids")
        assert len(children) == 1 and _alive(children[0])
    assert _wait_gone(children) == []


def test_what_a_worker_plugin_starts_dies_with_a_killed_trainer(tmp_path):
    """The worker died (PR_SET_PDEATHSIG) and left its plugin's children behind."""
    plugin = write(tmp_path, "starts.py", STARTS_A_CHILD)
    script = write(tmp_path, "trainer.py", f"""
        import time
        from areno.rewards import RewardScorer, RewardRecord
        if __name__ == "__main__":  # spawned workers import this file too
            s = RewardScorer({plugin!r}, workers=1, timeout=1000)
            s.submit([RewardRecord("p", "hang", None, None, {{}}, 1, "stop", 0)])
            while not (s._pool and all(w.ready and w.busy for w in s._pool)):
                time.sleep(0.05)
            print(s._pool[0].proc.pid, flush=True)
            time.sleep(1000)
    """)
    pid_file = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True,
                            env=child_env(CHILD_PID_FILE=str(pid_file)))
    pids: list[int] = []
    try:
        pids = [int(proc.stdout.readline())]
        deadline = time.monotonic() + 30
        while not _children_started(pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids += _children_started(pid_file)
        assert len(pids) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert _wait_gone(pids) == []
    finally:
        proc.kill()
        for pid in pids:  # only if the test failed: do not leak them
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead, only unreaped (its parent is gone; init reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_result_concat_adds_counts():
    a = RewardResult(np.ones(2, np.float32), np.ones(2, bool), RewardCounts(errors=1, zeroed=1), ("x",))
    b = RewardResult(np.zeros(1, np.float32), np.zeros(1, bool), RewardCounts(nan=1, skipped=1), ("y",))
    c = RewardResult.concat([a, b])
    assert c.rewards.tolist() == [1.0, 1.0, 0.0] and c.valid.tolist() == [True, True, False]
    assert c.counts == RewardCounts(errors=1, nan=1, zeroed=1, skipped=1) and c.messages == ("x", "y")


def test_plugin_may_start_processes_of_its_own(tmp_path):
    # Workers are daemons to the trainer, but a plugin (e.g. a code sandbox) may fork.
    path = write(tmp_path, "forks.py", """
        import multiprocessing
        def reward_fn(record):
            p = multiprocessing.get_context("fork").Process(target=lambda: None)
            p.start()
            p.join()
            return float(p.exitcode == 0)
    """)
    with RewardScorer(path, workers=1) as s:
        assert s.score(recs(["a"])).rewards.tolist() == [1.0]


def test_rewards_up_to_the_limit_are_kept_exactly_and_beyond_it_are_failures(scorers):
    """+-REWARD_LIMIT is a score (float32 holds 1e6 exactly); one ulp beyond it
    is a failure of kind nan, as 1e300 and +-1e38 are."""
    from areno.rewards.plugin import REWARD_LIMIT

    over = float(np.nextafter(REWARD_LIMIT, np.inf))
    r = scorers("skip").score(recs([f"big:{REWARD_LIMIT!r}", f"big:{-REWARD_LIMIT!r}", f"big:{over!r}",
                                    "big:1e300", "big:-1e38", "ok:1"]))
    assert r.valid.tolist() == [True, True, False, False, False, True]
    assert r.rewards[r.valid].tolist() == [REWARD_LIMIT, -REWARD_LIMIT, 1.0]
    assert r.counts == RewardCounts(nan=3, skipped=3)


def test_a_users_plugin_on_the_demo_keeps_workers_and_an_unenforceable_timeout_is_refused(tmp_path):
    """Issue 18: the demo scores in-process; a user's plugin there keeps the
    workers that enforce --reward-timeout, and a timeout given with
    --reward-workers 0 (which nothing in-process can enforce) is one line."""
    from areno.config.train import TrainConfig
    from areno.data.tasks.arith import DEMO_PRESET

    plugin = write(tmp_path, "mine.py", "def reward_fn(r):\n    return 0.0\n")
    assert TrainConfig.from_sources(None, {}).reward_workers == DEMO_PRESET["reward_workers"] == 0
    mine = TrainConfig.from_sources(None, {"reward_fn_path": plugin})
    assert mine.is_demo and mine.reward_workers == TrainConfig.reward_workers > 0
    assert TrainConfig.from_sources(None, {"reward_fn_path": plugin, "reward_workers": 0}).reward_workers == 0
    with pytest.raises(UserError, match=r"--reward-timeout 2.0 cannot be enforced with --reward-workers 0"):
        TrainConfig.from_sources(None, {"reward_workers": 0, "reward_timeout": 2.0})


def test_a_plugin_whose_import_blocks_is_bounded_and_named(tmp_path, monkeypatch):
    """Start-up used to hang on it with no word, whatever --reward-workers."""
    import areno.rewards.plugin

    release = tmp_path / "release"
    plugin = tmp_path / "waits.py"
    plugin.write_text(f"import os, time\nwhile not os.path.exists({str(release)!r}):\n    time.sleep(0.02)\n"
                      "def reward_fn(record):\n    return 0.0\n")
    monkeypatch.setattr(areno.rewards.plugin, "IMPORT_TIMEOUT_S", 0.5)  # load_bounded's bound
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardError) as e:
            RewardScorer(str(plugin), workers=0)
        assert time.monotonic() - t0 < 5
        assert str(e.value) == (f"reward plugin {plugin}: its import did not finish within 0.5 s "
                                "(does it wait on something at import time?)")
    finally:
        release.write_text("")  # the abandoned import thread ends
