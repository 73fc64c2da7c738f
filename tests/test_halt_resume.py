"""Ctrl-C under --partial-rollouts halts the rounds in flight mid-generation,
saves their tokens, and the resumed run continues them: no generated token is
lost, none generated twice (areno/continuation.py, fleet/inflight_loads.py's
halt). In-process against a real engine process."""

from __future__ import annotations

import os
import signal

import numpy as np

from areno.rollout.batch import FINISH_ABORT

ARGS = ["--batch-size", "4", "--n-samples", "4", "--rollout-engine", "hf", "--world-size", "1",
        "--rollout-world-size", "1", "--off-policy-steps", "1", "--partial-rollouts", "--max-new-tokens", "8",
        "--max-steps", "3", "--seed", "0"]


def rows(ids: np.ndarray, off: np.ndarray) -> list[np.ndarray]:
    return [ids[a:z] for a, z in zip(off[:-1], off[1:])]


def saved_responses(ckpt) -> dict[int, list[tuple]]:
    """prompt index -> its saved samples (tokens, log-probs, versions, finish)."""
    from areno.inflight_file import INFLIGHT_FILE

    out: dict[int, list[tuple]] = {}
    with np.load(ckpt / INFLIGHT_FILE) as z:
        for i in range(len([k for k in z.files if k.endswith("/prompt_idx")])):
            off = z[f"{i}/response_offsets"]
            cols = [rows(z[f"{i}/{k}"], off) for k in ("response_ids", "response_logprobs", "token_version")]
            for r, g in enumerate(z[f"{i}/group_index"].tolist()):
                prompt = int(z[f"{i}/prompt_idx"][g])
                out.setdefault(prompt, []).append((*(c[r] for c in cols), int(z[f"{i}/finish_reason"][r])))
    return out


def halted_run(tmp_path, areno_cache, monkeypatch, args: list[str], gated: bool = True):
    """`areno train args` in process, the engine gated (halt_gate_hooks.py; not
    unless `gated`), a SIGINT right after step 1's update -> (its result, the
    step-1 checkpoint)."""
    from areno.scheduler import Rollouts
    from inprocess import run_here

    publish = Rollouts.publish

    def publish_then_ctrl_c(sched, step, updated):
        out = publish(sched, step, updated)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out
    monkeypatch.setattr(Rollouts, "publish", publish_then_ctrl_c)
    out = tmp_path / "run"
    try:
        res = run_here(["train", *args, "--output-dir", str(out)], areno_cache,
                       env={"ARENO_RANK_HOOKS": "halt_gate_hooks:HaltGate"} if gated else None)
    finally:
        monkeypatch.setattr(Rollouts, "publish", publish)
    return res, out / "checkpoints" / "step_000001"


def trained_on_resume(tmp_path, areno_cache, monkeypatch, args: list[str], ckpt) -> tuple[int, dict[int, list[tuple]]]:
    """Resume `args` from ckpt -> (rounds trained, prompt index -> its trained
    samples (tokens, log-probs, versions, finish, reward) in group order)."""
    from areno import first_finished
    from inprocess import run_here
    from test_resume import ok

    trained: list = []
    take = first_finished.next_groups

    def spied(sched, step, timer, informative=None):
        got = take(sched, step, timer, informative)
        trained.append(got[0].round)
        return got
    monkeypatch.setattr(first_finished, "next_groups", spied)
    ok(run_here(["train", *args, "--no-save", "--output-dir", str(tmp_path / "resumed"), "--resume", str(ckpt)],
                areno_cache))
    got: dict[int, list[tuple]] = {}
    for r in trained:
        b = r.batch
        cols = [rows(a, b.response_offsets) for a in (b.response_ids, b.response_logprobs, b.token_version)]
        for i, g in enumerate(b.group_index.tolist()):
            got.setdefault(int(r.prompt_idx[g]), []).append((*(c[i] for c in cols), int(b.finish_reason[i]),
                                                             float(r.scored.rewards[i])))
    return len(trained), got


def test_a_ctrl_c_halts_the_rounds_in_flight_and_the_resumed_run_continues_every_token(
        tmp_path, areno_cache, monkeypatch):
    """Split placement, K = 1, partial rollouts, the engine gated (halt_gate_hooks.py)
    so that round 2 is still generating, at decode step HALT_STEP, when a SIGINT
    comes right after step 1's update. The run halts it (and round 3, queued)
    instead of waiting, saves step 1 with their samples cut short (finish
    "abort"; versions 0 and 1), exits 130. Resumed, steps 2 and 3 train every saved
    sample with its saved tokens, log-probs and versions first, each halted one
    continued by version 1 to a finish of its own: the tokens counted across the
    interruption are all there."""
    from halt_gate_hooks import HALT_STEP

    res, ckpt = halted_run(tmp_path, areno_cache, monkeypatch, ARGS)
    assert res.returncode == 130, res.stderr[-3000:]
    assert "halting the 2 rollout(s) in flight at their next decode step" in res.stdout, res.stdout[-3000:]
    saved = saved_responses(ckpt)
    samples = [s for group in saved.values() for s in group]
    assert len(saved) == 8 and len(samples) == 32  # rounds 2 and 3, whole
    halted = [s for s in samples if s[3] == FINISH_ABORT]
    assert halted and all(1 <= s[0].size <= HALT_STEP for s in halted)
    assert set(np.concatenate([s[2] for s in samples]).tolist()) == {0, 1}  # round 2's version, round 3's

    rounds, got = trained_on_resume(tmp_path, areno_cache, monkeypatch, ARGS, ckpt)
    assert rounds == 2
    assert sorted(got) == sorted(saved)  # every saved group trained, once
    kept = continued = 0
    for prompt, group in saved.items():
        for (ids, lp, ver, finish), (ids2, lp2, ver2, finish2, _) in zip(group, got[prompt], strict=True):
            n = ids.size
            np.testing.assert_array_equal(ids2[:n], ids)
            np.testing.assert_array_equal(lp2[:n], lp)
            np.testing.assert_array_equal(ver2[:n], ver)
            kept += n
            if finish == FINISH_ABORT:
                assert finish2 != FINISH_ABORT and set(ver2[n:].tolist()) <= {1}
                continued += ids2.size - n
            else:
                assert ids2.size == n and finish2 == finish
    assert kept == sum(s[0].size for s in samples) and continued > 0
