"""scripts/bench_async.py with tiny costs: the real `areno train` at K = 0 and
1 runs with the stand-ins (RankHooks in the rank and in the engine
process) really applied, fixed and heavy-tailed, prints the table, and K = 1
hides the rollout behind training (its step shorter than K = 0's by the overlap)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arenobench.lib import child_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_async.py"


@pytest.mark.timing
def test_bench_async_stand_ins_apply_and_k1_overlaps(tmp_path: Path) -> None:
    R = T = 0.4
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--train-s", str(T), "--ratios", "1", "--steps", "5",
                           "--ks", "0,1", "--tail-steps", "4", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=400, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| scenario | K | mean R | T | step (mean) |" in proc.stdout
    assert "| R/T 1 | 1 | 0.4 s | 0.4 s |" in proc.stdout and "| tail | 1 |" in proc.stdout
    assert "targets:" in proc.stdout
    fixed, tail = json.loads(out.read_text())["scenarios"]
    rows = {r["k"]: r for r in fixed["rows"]}
    # 3 train commands and 3 rollouts per run went through the hooks: the engine
    # process's rollout_begin/rollout_end as well as the rank's train_begin/train_end
    assert all(r["train_cmds"] == 5 and r["rollout_cmds"] == 5 for r in rows.values()), rows
    assert all(r["max_overrun_s"] <= 0 for r in rows.values()), "the real work took longer than a stand-in"
    assert rows[0]["median_step_s"] >= R + T, rows  # synchronous: rollout, then train, each at its cost
    assert rows[1]["median_step_s"] >= max(R, T) and rows[1]["lag_mean"] > rows[0]["lag_mean"], rows
    # K = 1 overlaps: the rollout's R s run while the rank trains, so a step is
    # max(R, T) + overheads where K = 0's is R + T + the same overheads (a median of 3
    # steps each). Without overlap the saving is ~0; at least half of min(R, T) is asked.
    saved = rows[0]["median_step_s"] - rows[1]["median_step_s"]
    assert saved >= 0.5 * min(R, T), f"K=1 saved {saved:.3f} s of K=0's {rows[0]['median_step_s']:.3f} s"
    # the tail's rollouts took the drawn times: as many commands, none at the fixed R
    assert [r["rollout_cmds"] for r in tail["rows"]] == [4, 4] and tail["rows"][0]["rollout_mean_s"] != R


def test_bench_async_partial_mode_reports_the_three_modes_side_by_side(tmp_path: Path) -> None:
    """--partial: sync, K-ahead and partial rollouts at the same K on both long-tail
    workloads (simulated: arenobench/partial_sim.py), in one run; partial keeps
    the engines busier and trains more tokens per tick, every token within K;
    the run's own scheme (whole rounds with tail fill, batches by deadline_first)
    beside its whole-round variant and --cut-at-deadline."""
    out = tmp_path / "partial.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--partial", "--partial-steps", "6", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| mode | K | trained tokens/tick | x sync | x K-ahead | engine idle |" in proc.stdout
    rows = json.loads(out.read_text())["partial"]
    assert len(rows) == 2 and any("env" in name for name in rows)
    for name, (sync, ahead, part, whole, first, cut) in rows.items():
        assert [r["mode"] for r in (sync, ahead, part, whole, first, cut)] == \
            ["sync", "K-ahead", "partial", "tail fill, whole rounds", "first-finished",
             "first-finished, cut at deadline"]
        # --cut-at-deadline: nothing retired, no token past K, the engines no idler
        assert cut["retired"] == 0.0 and len(cut["lag_hist"]) == 3 and cut["idle"] <= first["idle"], name
        # what --partial-rollouts runs: rounds admitted whole, nothing retired, no token past K
        assert first["trained_tokens_per_tick"] >= whole["trained_tokens_per_tick"], name
        assert whole["retired"] == first["retired"] == 0.0 and len(first["lag_hist"]) == 3, name
        assert sync["k"] == 0 and ahead["k"] == part["k"] == 2
        assert part["trained_tokens_per_tick"] > ahead["trained_tokens_per_tick"] >= \
            sync["trained_tokens_per_tick"], name
        assert part["idle"] < ahead["idle"], name
        assert len(part["lag_hist"]) == 3 and sync["lag_hist"][1:] == [] and sync["retired"] == 0.0


@pytest.mark.bench
def test_bench_async_partial_real_runs_sync_k_ahead_and_partial_rollouts_side_by_side(tmp_path: Path) -> None:
    """--partial-real: the real loop on the tail at K = 0, K-ahead and
    --partial-rollouts (arenobench/partial_real.py), one table. A K-ahead round
    samples with one version (token lag = policy lag); a partial one's later
    tokens may come from newer weights (token lag <= policy lag, never above)."""
    out = tmp_path / "partial_real.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--partial-real", "--train-s", "0.2", "--tail-steps", "5",
                           "--partial-k", "1", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| mode | step (mean) | vs sync | trained tok/s | engine idle | wait_batch | policy lag | token lag " \
        "| in-flight loads/step | tail-filled/step |" in proc.stdout
    sync, ahead, part = json.loads(out.read_text())["partial_real"]
    assert all(r["trained_tokens_per_s"] > 0 and 0 <= r["engine_idle_frac"] <= 1 for r in (sync, ahead, part))
    assert [r["k"] for r in (sync, ahead, part)] == [0, 1, 1] and part["mode"] == "partial (K=1)"
    assert sync["policy_lag_mean"] == sync["inflight_loads_per_step"] == ahead["inflight_loads_per_step"] == 0
    assert ahead["token_lag_mean"] == ahead["policy_lag_mean"] == 1
    assert part["token_lag_mean"] <= part["policy_lag_mean"] <= 1 and part["measured_steps"] >= 1


def test_the_partial_targets_judge_first_finished_as_well_as_the_pool() -> None:
    """bench_async --partial's "targets:" line names each partial mode that missed
    one: the pool's (`partial`) and first-finished, what areno runs, which an
    idle engine no longer hides behind a busy pool."""
    import numpy as np

    from arenobench.partial_sim import Result, misses

    def res(mode: str, tokens: int, idle: float) -> Result:
        return Result(mode, 2, 100.0, tokens, tokens, idle, np.zeros(1, np.int64))

    sync, ahead = res("sync", 1000, 0.7), res("K-ahead", 1200, 0.6)
    busy_pool, idle_ff = res("partial", 3000, 0.02), res("first-finished", 3000, 0.28)
    assert misses([sync, ahead, busy_pool, res("tail fill, whole rounds", 2900, 0.3), idle_ff]) == \
        ["first-finished idle 28.0% > 5%"]
    slow_ff = res("first-finished", 1500, 0.04)
    assert misses([sync, ahead, busy_pool, slow_ff]) == \
        ["first-finished 1.50x sync < 2.0", "first-finished 1.25x K-ahead < 1.5"]
