"""The asynchronous loop (--off-policy-steps K with --rollout-world-size M, issues
20 and 27): rollouts on reply lanes of their own while the ranks train, queued
on the engines up to K ahead, the published weights loaded at the start of the
next rollout and checked, the policy lag it logs (and its distribution), exact
resume from a periodic checkpoint (every rollout in flight saved), Ctrl-C (the
rollouts in flight saved, exact again), parts streamed and scored while the
ranks train, and the demo learning at K = 1 and K = 4."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from areno.inflight_file import INFLIGHT_FILE, INFLIGHT_META, load_inflight
from areno.scheduler import admitted
from areno.errors import UserError
from areno.fleet.rollouts import Parts
from areno.rundir.checkpoint import latest_checkpoint, read_state
from inprocess import run_here
from test_backend_units import make_split
from test_demo_learns import STOP, assert_learned
from test_faults import assert_complete, wait_for
from test_interrupt import interrupt_after, resume_line
from test_resume import (FLAGS, HF1, REPO, assert_resume_repeats, assert_same_steps, cli_env,
                         eval_flags, expected_prompt_hashes, ok, popen_train, train_steps)  # noqa: F401 (fixture)
from test_split_placement import PROMPTS, backend_config, split_placement

# Whole rounds (--whole-rounds): this file holds the deterministic loop, whose
# resume is exact; split placement at K >= 1 takes partial rollouts unless told
# not to (tests/test_partial_rollouts.py and test_halt_resume.py hold those).
K1 = ["--rollout-world-size", "1", "--off-policy-steps", "1", "--whole-rounds"]
LEARNED_AT_300 = 0.6  # the 20-step mean reward at step 300 of the demo
K2 = ["--rollout-world-size", "1", "--off-policy-steps", "2", "--whole-rounds"]


def test_admission_bounds_the_lag_by_k():
    # A rollout sampled with version v, trained once the trainer holds u updates: lag u - v.
    assert admitted(1, 0, 1) and admitted(5, 4, 1)
    assert not admitted(5, 3, 1)  # two versions behind: held back at K = 1
    assert not admitted(1, 0, 0)  # K = 0: only the current weights (the synchronous loop)
    assert admitted(0, 0, 0)


def collected(pending):
    """-> (a pending rollout's batch, its collect info)."""
    info = pending.collect()
    return pending.sink.merge()[0], info


def write_inflight(ckpt: Path, steps: list[int]) -> None:
    """inflight.npz/.json as checkpoint_state writes them, one small rollout per step."""
    arrays = {}
    for i in range(len(steps)):
        arrays |= {f"{i}/prompt_ids": np.arange(3, dtype=np.int32), f"{i}/prompt_offsets": np.array([0, 3]),
                   f"{i}/response_ids": np.arange(4, dtype=np.int32), f"{i}/response_offsets": np.array([0, 2, 4]),
                   f"{i}/response_logprobs": np.zeros(4, np.float32), f"{i}/group_index": np.zeros(2, np.int64),
                   f"{i}/finish_reason": np.zeros(2, np.uint8), f"{i}/prompt_idx": np.array([i])}
    np.savez(ckpt / INFLIGHT_FILE, **arrays)
    (ckpt / INFLIGHT_META).write_text(json.dumps({"rollouts": [
        {"step": s, "version": s - 1, "sampler_before": {"epoch": 0, "pos": s}} for s in steps]}))


@pytest.mark.parametrize("damage,why", [
    ("no npz", "inflight.npz is missing"), ("no json", "inflight.json is missing"),
    ("cut npz", "inflight.npz is truncated or unreadable ("), ("cut json", "inflight.json is truncated or unreadable ("),
    ("short", "inflight.json lists 1 rollouts, trainer_state.json 2"), ("none", "inflight.json is missing"),
    ("state", "inflight.npz is truncated or unreadable (ModuleNotFoundError: No module named 'gone_env_module')")])
def test_a_checkpoints_damaged_in_flight_files_are_refused_in_one_line_naming_the_file(tmp_path, damage, why):
    write_inflight(tmp_path, [4, 5])
    assert [r.step for r in load_inflight(tmp_path, 2)] == [4, 5]  # whole: read back
    npz, meta = tmp_path / INFLIGHT_FILE, tmp_path / INFLIGHT_META
    if damage == "short":
        write_inflight(tmp_path, [4])
    if damage == "state":  # a halted env trajectory's state of a class its file no longer defines
        with np.load(npz) as z:
            arrays = dict(z)
        np.savez(npz, **arrays, **{"0/rewards": np.zeros(2, np.float32), "0/valid": np.ones(2, bool),
                                   "0/halted": np.frombuffer(b"cgone_env_module\nState\n.", np.uint8)})
    for f, cut in ((npz, "npz"), (meta, "json")):
        if damage in (f"no {cut}", "none"):
            f.unlink()
        elif damage == f"cut {cut}":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UserError) as e:
        load_inflight(tmp_path, 2, "resume from another checkpoint (--resume X)")
    name, problem = why.split(" ", 1)
    assert str(e.value).startswith(f"--resume {tmp_path}: {name} (the rollouts in flight when it was saved) "
                                   f"{problem}"), str(e.value)
    assert str(e.value).endswith("; resume from another checkpoint (--resume X)") and "\n" not in str(e.value)


def test_a_rollout_runs_beside_a_train_command_and_loads_the_published_weights_first(tiny_chat_path):
    from areno.procs.errors import BackendError
    from areno.rollout.engine import SamplingConfig

    sampling = SamplingConfig(max_tokens=4, seed=3)
    with split_placement(backend_config(tiny_chat_path, 1)) as (be, fleet, engines):
        v0 = engines.generate(*PROMPTS, 2, sampling)
        pending = engines.start_rollout(*PROMPTS, 2, sampling, None)
        steps = be.train(make_split(1))  # the ranks answer on the main lane while the rollout is out
        assert steps and be.step == steps[-1]["step"]
        region = be.publish_weights(slot=1)
        out, info = collected(pending)
        np.testing.assert_array_equal(out.response_logprobs, v0.response_logprobs)  # still version 0
        assert "sync_load_s" not in info and info["idle_s"] >= 0

        out, info = collected(engines.start_rollout(*PROMPTS, 2, sampling, region))
        assert info["sync_load_s"] > 0  # loaded (and checked) before it sampled
        assert not np.array_equal(out.response_logprobs, v0.response_logprobs)
        engines.sync_weights()  # the same version through the synchronous path (slot 0)
        np.testing.assert_array_equal(engines.generate(*PROMPTS, 2, sampling).response_logprobs,
                                      out.response_logprobs)

        be.train(make_split(1))
        region = be.publish_weights(slot=0)
        entry = next(e for e in region.layout.entries if ".layers." in e.name)
        be._weights[0].buf[entry.offset + 2] ^= 0x40  # one bit of one weight: the check must see it
        with pytest.raises(BackendError, match="WeightSyncError"):
            collected(engines.start_rollout(*PROMPTS, 2, sampling, region))


class _Sink(Parts):
    """Records, for each part the controller takes, whether the rollout was whole
    then and which command the controller was waiting for; opens the gate."""

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate, self.seen, self.pending, self.waiting = gate, [], None, "nothing"

    def score(self, pos, part) -> None:
        self.seen.append((int(pos[0]), self.pending.whole, self.waiting))
        self.gate.touch()


def test_a_rollouts_parts_reach_the_controller_while_it_runs_and_while_the_ranks_train(
        tiny_chat_path, tmp_path, monkeypatch):
    """Issue 27, 2: under split placement the engine streams each finished part and
    the controller reads it during any wait (here: train commands on the main
    lane), so it can score it while generation runs. The gated engine
    (gated_rollout_hooks.py) generates the rest only once the first part was
    taken: with parts sent only in the final reply, this waits out the gate and
    fails."""
    from areno.rollout.engine import SamplingConfig

    gate = tmp_path / "gate"
    monkeypatch.setenv("ARENO_RANK_HOOKS", "gated_rollout_hooks:GatedParts")
    monkeypatch.setenv("ARENO_TEST_PART_GATE", str(gate))
    sampling = SamplingConfig(max_tokens=4, seed=3)
    with split_placement(backend_config(tiny_chat_path, 1)) as (be, fleet, engines):
        sink = _Sink(gate)
        sink.pending = pending = engines.start_rollout(*PROMPTS, 2, sampling, None, sink)
        sink.waiting = "train"
        for _ in range(100):  # the first part comes within a few train commands
            be.train(make_split(1))
            if gate.exists():
                break
        sink.waiting = "collect"
        pending.collect()
        out, _ = sink.merge()
    assert sink.seen[0] == (0, False, "train")  # taken during a train command, the rollout not whole
    assert [p for p, _, _ in sink.seen] == [0, 1, 2]
    np.testing.assert_array_equal(np.diff(out.prompt_offsets), np.diff(PROMPTS[1]))


def k1_run(out, areno_cache, *extra: str, steps: int = 6, k: list[str] = K1) -> dict[int, dict]:
    ok(run_here(["train", *HF1, *k, "--max-steps", str(steps), "--seed", "0", "--output-dir", str(out),
                 *extra], areno_cache))
    return train_steps(out)


def saved_steps(ckpt: Path) -> list[int]:
    """The steps of the rollouts a checkpoint holds in flight."""
    if not (ckpt / INFLIGHT_FILE).is_file():
        return []
    return [r["step"] for r in json.loads((ckpt / "inflight.json").read_text())["rollouts"]]


def test_k1_lags_one_version_and_resumes_exactly_from_a_checkpoint_with_a_rollout_in_flight(
        tmp_path, areno_cache):
    full = k1_run(tmp_path / "full", areno_cache, "--save-interval", "3", "--keep-last", "0")
    assert [full[s]["rollout/policy_lag_max"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    # per token too: every token of a step's round at the round's lag (one version a round)
    assert [full[s]["rollout/token_lag_mean"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    assert all(full[s]["rollout/token_lag_1"] > 0 == full[s]["rollout/token_lag_0"] for s in range(2, 7))
    assert all(full[s]["offpolicy/kl"] > 0 for s in range(2, 7))  # the sampler is one update behind
    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    # Step 4's rollout, sampled with step 2's weights, and 5's, sent after step 3's update.
    assert saved_steps(ckpt) == [4, 5]
    resumed = k1_run(tmp_path / "resumed", areno_cache, "--resume", str(ckpt))
    assert sorted(resumed) == [4, 5, 6]
    assert_same_steps(full, resumed, [4, 5, 6])  # lag, log-probs, rewards, losses: all the same
    assert {s: full[s]["data/prompt_hash"] for s in full} == expected_prompt_hashes(range(1, 7), 4)


@pytest.mark.faults  # K = 1 resumes exactly in the default tier (above); K = 2 in the fault tier
def test_k2_lags_0_1_2_2_and_resumes_exactly_from_a_checkpoint_with_three_rollouts_in_flight(
        tmp_path, areno_cache):
    full = k1_run(tmp_path / "full", areno_cache, "--save-interval", "3", "--keep-last", "0", k=K2)
    assert [full[s]["rollout/policy_lag_max"] for s in range(1, 7)] == [0, 1, 2, 2, 2, 2]
    # The distribution: every sample of a step at the step's lag, counted per lag.
    assert [[full[s][f"rollout/policy_lag_{lag}"] for lag in range(3)] for s in (1, 2, 3)] == \
        [[16, 0, 0], [0, 16, 0], [0, 0, 16]]
    assert all(full[s]["offpolicy/kl"] > 0 for s in range(2, 7))
    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    assert saved_steps(ckpt) == [4, 5, 6]  # K + 1 in flight after step 3's update
    for damage in ("missing", "truncated"):  # refused in one line naming the file, before any change
        assert_damaged_inflight_refused(ckpt, tmp_path / damage, damage, areno_cache)
    resumed = k1_run(tmp_path / "resumed", areno_cache, "--resume", str(ckpt), k=K2)
    assert sorted(resumed) == [4, 5, 6]
    assert_same_steps(full, resumed, [4, 5, 6])  # lag, log-probs, rewards, losses: all the same
    assert {s: full[s]["data/prompt_hash"] for s in full} == expected_prompt_hashes(range(1, 7), 4)


def assert_damaged_inflight_refused(ckpt: Path, where: Path, damage: str, areno_cache: Path) -> None:
    """A copy of `ckpt` whose inflight.npz is missing or cut in half: --resume is
    exit 2, one line naming the file (once it resumed silently on other prompts,
    or failed with a traceback)."""
    copy = where / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    npz = copy / INFLIGHT_FILE
    if damage == "missing":
        npz.unlink()
    else:
        npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    res = run_here(["train", *HF1, *K2, "--max-steps", "6", "--seed", "0", "--output-dir", str(where / "run"),
                    "--resume", str(copy)], areno_cache)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("areno:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-3000:]
    assert f"--resume {copy}: {INFLIGHT_FILE} (the rollouts in flight when it was saved) is {damage}" \
        in lines[0], lines[0]


@pytest.mark.faults
def test_the_synchronous_loops_resume_test_passes_with_k1(tmp_path, areno_cache, eval_flags):
    """test_resume's pair (vLLM rollouts, 2 gloo ranks, eval at 0, 2 and 4 with its
    own seeds, checkpoints at 2 and 4) with one engine process and K = 1: each eval
    first collects the rollout in flight and loads the newest weights."""
    flags = [*FLAGS, *eval_flags, *K1]
    full = tmp_path / "full"
    ok(run_here(["train", *flags, "--keep-last", "0", "--output-dir", str(full)], areno_cache))
    assert train_steps(full)[4]["rollout/policy_lag_max"] == 1
    assert_resume_repeats(full, tmp_path / "resumed", flags, areno_cache)


def ctrl_c_then_resume(tmp_path, areno_cache, k: list[str]) -> tuple[int, list[int], dict[int, dict]]:
    """A long run interrupted after its third step, resumed for two more steps ->
    (the step it stopped after, the steps its checkpoint saved in flight, every
    step's metrics: one metrics.jsonl)."""
    out = tmp_path / "run"
    proc = popen_train([*HF1, *k, "--max-steps", "5000", "--output-dir", str(out)], areno_cache)
    _, err = interrupt_after(proc, out, 3, signal.SIGINT, group=True)
    line = resume_line(err)
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None, err[-3000:]
    assert_complete(ckpt)
    stopped = int(read_state(ckpt)["step"])
    assert f"after step {stopped} of 5000" in line
    saved = saved_steps(ckpt)
    every = k1_run(out, areno_cache, "--resume", str(ckpt), steps=stopped + 2, k=k)
    assert sorted(every) == list(range(1, stopped + 3))
    # The data order is the uninterrupted run's: saved rollouts and those drawn again alike.
    want = expected_prompt_hashes(range(stopped + 1, stopped + 3), 4)
    assert {s: every[s]["data/prompt_hash"] for s in want} == want
    return stopped, saved, every


@pytest.mark.timing
@pytest.mark.parametrize("k", [K1, K2], ids=["k1", "k2"])
def test_ctrl_c_saves_the_rollouts_in_flight_and_the_resumed_run_trains_them(tmp_path, areno_cache, k):
    """Ctrl-C (issue 27: "Ctrl-C saves them"): the interrupt's checkpoint holds the
    rollouts in flight, which the tiny demo finishes well within the interrupt's
    wait (scheduler.INTERRUPT_WAIT_S), and the resumed run trains on them at the
    lag they were sampled with (dropped, they would come back at lag 0)."""
    stopped, saved, every = ctrl_c_then_resume(tmp_path, areno_cache, k)
    K = int(k[k.index("--off-policy-steps") + 1])
    assert saved and saved == list(range(stopped + 1, stopped + 1 + len(saved))) and len(saved) <= K + 1
    assert every[stopped + 1]["rollout/policy_lag_max"] == every[stopped]["rollout/policy_lag_max"] == K


@pytest.mark.learning
def test_the_demo_learns_with_k1_and_an_engine_process(tmp_path, areno_cache):
    """Seeded (0): the embedded demo with its engine in a process of its own, one
    rollout ahead, for at most half the demo's steps, ended by --stop-at-reward
    LEARNED_AT_300. Measured at seed 0: the 20-step mean reward at step 300 is 0.87
    (K = 0: 0.80), and it first holds 0.6 at step 159. The mastery bar is held by
    K = 4 (below), whose samples are staler."""
    out = tmp_path / "demo"
    ok(run_here(["train", *K1, "--seed", "0", "--max-steps", "300", "--no-save", "--stop-at-reward",
                 str(LEARNED_AT_300), "--output-dir", str(out)], areno_cache))
    rewards = np.array([r["reward/mean"] for _, r in sorted(train_steps(out).items())])
    assert_learned(rewards, 300, LEARNED_AT_300)


@pytest.mark.learning
def test_the_demo_learns_with_k4(tmp_path, areno_cache):
    """Seeded (0): the embedded demo four rollouts ahead (every step from the 5th
    on trains on samples four versions old), held to the same bar as K = 1 and
    the synchronous demo, within 400 of the demo's 600 steps (its cosine schedule
    ends at 400), ended by --stop-at-reward. Measured at seed 0: 0.057 -> 0.938 at
    step 400, the 20-step mean at 0.9 by step 273 (where the run stops); at 600
    steps 0.976 (issue 27)."""
    out = tmp_path / "demo"
    ok(run_here(["train", *K2[:3], "4", "--whole-rounds", "--seed", "0", "--no-save",
                 *STOP, "--max-steps", "400", "--output-dir", str(out)], areno_cache))
    steps = train_steps(out)
    rewards = np.array([r["reward/mean"] for _, r in sorted(steps.items())])
    assert all(r["rollout/policy_lag_max"] == 4 for s, r in steps.items() if s >= 5)
    assert_learned(rewards, 400)


def test_an_abandoned_rollout_leaves_the_ranks_usable_and_its_engine_takes_no_more_commands(tiny_chat_path):
    """Ctrl-C while the loop waits for a long rollout: the stream is abandoned
    (settled) with the engine still busy. The ranks must still train and save
    (the interrupt's checkpoint), the engine refuses further commands, and
    close() does not wait for its rollout."""
    from areno.procs.errors import BackendError

    with split_placement(backend_config(tiny_chat_path, 1)) as (be, fleet, engines):
        stream = fleet.open_stream("rollout", lane="rollout", detach=True)
        stream.send(0, "debug", action="sleep", seconds=60.0)  # a rollout that will not end soon
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C in the wait
        with pytest.raises(KeyboardInterrupt):
            stream.gather(120)
        assert be.train(make_split(1))  # the ranks answer on the main lane
        with pytest.raises(BackendError, match="engine process 0 is still in an abandoned command"):
            fleet.open_stream("generate").send(0, "debug", action="sleep", seconds=0.0)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3.0  # close() killed the busy engine instead of waiting 60 s


@pytest.mark.timing
def test_k1_ctrl_c_while_waiting_for_a_minute_long_rollout_saves_within_seconds(tmp_path, areno_cache):
    """The third rollout takes a minute (slow_rollout_hooks.py): step 3 waits for it
    when the Ctrl-C comes. The ranks save step 2 at once; the busy engine process
    is stopped, not waited for."""
    out = tmp_path / "run"
    env = {**cli_env(areno_cache), "ARENO_RANK_HOOKS": "slow_rollout_hooks:SlowRollouts",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "areno.cli", "train", *HF1, *K1, "--max-steps", "50",
                             "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env, start_new_session=True)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, proc)
    time.sleep(1.0)  # step 3 is in its collect now, the rollout has ~59 s to go
    t0 = time.monotonic()
    _, err = interrupt_after(proc, out, 0, signal.SIGINT, group=True)
    assert time.monotonic() - t0 < 15, err[-2000:]
    assert "after step 2 of 50" in resume_line(err)
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000002", err[-3000:]
    assert_complete(ckpt)


def test_the_ranks_default_to_the_gpus_the_engine_processes_leave(monkeypatch, files):
    """8 GPUs and --rollout-world-size 4: four ranks (the README's 4 + 4 command)."""
    from areno.runtime import placement as run
    from areno.config.train import TrainConfig

    monkeypatch.setattr(run, "visible_gpus", lambda: 8)
    cfg = TrainConfig.from_sources(None, {**files, "rollout_world_size": 4, "off_policy_steps": 1})
    assert run.ranks_for(cfg, "cuda") == (4, 4)
    run.check_placement(cfg, 4, 4, "cuda")  # 4 + 4 fit in 8
    assert run.ranks_for(TrainConfig.from_sources(None, files), "cuda") == (8, 8)
