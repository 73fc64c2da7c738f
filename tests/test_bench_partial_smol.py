"""`bench_async.py --partial-smol`'s parts that need no model: the long-tailed
task it writes, and the medians it reports (the runs themselves are minutes
of the real model on vLLM CPU: the benchmark's, not the suite's)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from arenobench.partial_smol import SKIP, summary, tail_task


def test_the_task_mixes_sums_with_a_heavy_tail_of_counting_prompts_and_its_reward_loads(tmp_path: Path) -> None:
    data, reward = tail_task(tmp_path, 400, long_every=4, sigma=1.5)
    rows = [json.loads(ln) for ln in data.read_text().splitlines()]
    long = [r for r in rows if r["prompt"].startswith("Count")]
    assert len(rows) == 400 and len(long) == 100
    assert all(r["answer"] == str(int(r["answer"])) for r in rows)
    counts = np.array([int(r["answer"]) for r in long])
    # lognormal(1.5) scaled by 8: a median near 11, a tail reaching the 203 cap
    assert 6 <= np.median(counts) <= 20 and counts.max() >= 100 and counts.max() <= 203
    spec = importlib.util.spec_from_file_location("tail_reward", reward)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Rec:
        answer, completion = "12", "12"
    assert 0.99 < mod.reward_fn(Rec) < 1.0


def test_the_summary_takes_medians_after_the_warm_up_steps() -> None:
    steps = [{"time/step": 100.0, "train/loss_tokens": 1.0, "time/wait_weights": 0.0, "response/len_mean": 1.0,
              "response/len_max": 999.0}] * SKIP
    steps += [{"time/step": s, "train/loss_tokens": 10.0 * s, "time/wait_weights": 0.5 * s,
               "rollout/token_lag_mean": 0.25, "response/len_mean": 40.0, "response/len_max": m}
              for s, m in [(2.0, 90.0), (4.0, 160.0), (3.0, 50.0)]]
    row = summary("partial (K=2)", steps)
    assert row["measured_steps"] == 3 and row["step_s"] == 3.0
    assert row["trained_tokens_per_s"] == 10.0 and row["engine_idle_frac"] == 0.5
    assert row["len_max"] == 160.0 and row["token_lag_mean"] == 0.25 and row["inflight_loads"] == 0.0
