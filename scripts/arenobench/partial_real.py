"""`bench_async.py --partial-real`: the real loop on the long tail, K = 0, K-ahead
and --partial-rollouts at the same K, side by side.

The runs are async_loop.py's (`areno train`, one rank, one engine process, the
demo's tiny model, FixedCostHooks' stand-ins on the tail's rollout times), with
each rollout's stand-in time held before it decodes (HOLD_ENV "begin"): weights
the ranks publish meanwhile reach a --partial-rollouts round at its first decode
step boundary, as they would reach a long generation part way through.

What it can show: the partial mode takes fresher weights (a lower token lag,
rollout/inflight_loads per step) at about the K-ahead step time. Its batches
form from the groups that finish first (first_finished.py), but a stand-in
round here comes back as one part, and in steady state deadline_first must
take the oldest round whole anyway (docs/DESIGN.md, "Batches from what
finishes"); arenobench/partial_sim.py simulates what group-by-group admission
would add. Tail fill (fleet/tail_fill.py) does not
show here: a stand-in holds each round a fixed time before it decodes, so a
round has no decoding tail for the next to fill; arenobench/tail_fill.py
measures it on an engine alone (vLLM, or --engine hf).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from arenobench.async_loop import HOLD_ENV, mean, run_one, tail_times


def partial_real(k: int, train_s: float, steps: int, tail_ratio: float, completions: int, sigma: float,
                 tmp: Path) -> tuple[str, list[dict]]:
    """The three runs -> (a markdown table, its rows)."""
    times = tail_times(steps + k + 2, tail_ratio * train_s, completions, sigma)
    (tmp / "tail.json").write_text(json.dumps(times))
    modes = [("sync (K=0)", 0, ()), (f"K-ahead (K={k})", k, ()),
             (f"partial (K={k})", k, ("--partial-rollouts",))]
    rows = []
    for name, kk, extra in modes:
        run = run_one(kk, float(np.mean(times)), train_s, steps, tmp, tmp / "tail.json", extra=extra,
                      env_extra={HOLD_ENV: "begin"}, tag="-partial" if extra else "")
        rows.append({"mode": name, "k": kk, "step_s": mean(run, "time/step"),
                     "wait_batch_s": mean(run, "time/wait_batch"),
                     "policy_lag_mean": mean(run, "rollout/policy_lag_mean"),
                     "token_lag_mean": mean(run, "rollout/token_lag_mean"),
                     "inflight_loads_per_step": mean(run, "rollout/inflight_loads"),
                     "tail_filled_per_step": mean(run, "rollout/tail_filled"),
                     "trained_tokens_per_s": mean(run, "train/loss_tokens") / mean(run, "time/step"),
                     # the engine's idle time (its replies' idle_s, summed per step) over the step's
                     "engine_idle_frac": mean(run, "time/wait_weights") / mean(run, "time/step"),
                     "measured_steps": len(run["steps"])})
        print(f"  {name}: {rows[-1]['step_s']:.3f} s/step", flush=True)
    sync = rows[0]["step_s"]
    out = ["| mode | step (mean) | vs sync | trained tok/s | engine idle | wait_batch | policy lag | token lag "
           "| in-flight loads/step | tail-filled/step |", "| --- " * 10 + "|"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['step_s']:.3f} s | {sync / r['step_s']:.2f}x | "
                   f"{r['trained_tokens_per_s']:.0f} | {100 * r['engine_idle_frac']:.0f}% | "
                   f"{1e3 * r['wait_batch_s']:.0f} ms | {r['policy_lag_mean']:.2f} | {r['token_lag_mean']:.2f} | "
                   f"{r['inflight_loads_per_step']:.2f} | {r['tail_filled_per_step']:.2f} |")
    return "\n".join(out), rows
