#!/usr/bin/env python
"""Long-CoT step benchmark: the real trainer loop at ~1M response tokens per step,
with a synthetic rollout engine and the real backend on CPU ranks, against the
list-based reference of scripts/listref.py wired into the same loop.

What runs (one process tree, one run):

  controller  `open_run(cfg, engine=SyntheticEngine(...))` with the tiny "chat"
              model, a JSONL dataset of P prompts and a reward plugin written to
              a temp dir; then `areno.trainer.train_step` (the real step:
              rollout, decode, reward, advantages, pack, backend.train, weight
              export) for the areno modes, and longcot_ref.ref_train_step for
              the reference (same Run: same engine, reward workers, backend ranks).
  engine      longcot_sim.SyntheticEngine: precomputed responses, a modelled
              generation timeline; the trainer asks the stream for every
              finished group at once (min_groups=1).
  reward      a plugin whose per-sample cost the bench sets between modes: 0
              ("free") or --reward-ms (time.sleep, or a busy-wait with
              --reward-busy); the reward is len(completion) % 5 / 4.
  backend     TorchBackend, --world-size gloo CPU ranks (FSDP2), the real
              shared-memory hand-off. Training a 1M-token step fully takes the
              tiny model tens of minutes on 2 cores, so by default each rank
              trains each optimizer step on only its last --train-micro
              micro-batch; the whole pack is still written, mapped and copied
              to the rank's device tensors (longcot_ranks.py).

Measured per step (controller clock = time.monotonic, shared with the ranks):

  critical    host critical path: from the end of generation (the engine's
              last group finishing) to the end of the hand-off write, split by
              phase as the union of the phase's intervals inside that window:
              decode, reward (records + submit + wait), advantages, pack (incl.
              split planning), merge (streamed parts put back in prompt order,
              rewards included), hand-off (the backend's input check +
              shared-memory write), other (glue). cpu: the controller main
              thread's CPU time in the phases it runs itself (all but the hand-off).
  handoff     hand-off write and ready: from the call of backend.train until
              the last rank has mapped its share.
  first wait  the first rank's wait at a probe collective before the first
              forward, its baseline, the ranks' arrival skew and prep work.
  readbacks   Tensor.item/tolist/cpu calls on each rank per optimizer step,
              with their call sites.
  RSS         the controller's peak RSS in the step (VmHWM reset through
              /proc/self/clear_refs) and its growth over the step's start.
  also        train time (rank compute), weight export, host work outside the
              window (before generation + after the weight sync), load average.

How, without patching areno: the controller's phases are the spans of the
PhaseTimer(keep_spans=True) the bench passes to train_step (areno/trainer.py);
the generation window and the bracket of backend.train (with the backend's
last_timings) come from the bench's own engine; the rank figures from RankHooks
(areno/backend/hooks.py) that longcot_ranks.py installs through ARENO_RANK_HOOKS.

Modes (one step of each per round, rounds repeated --steps times, after a
warm-up round; each round replays the same prompts in every mode):

  areno_overlap_free   train_step, --overlap-rewards (default), free reward
  reference_free       the list reference, handed off by the same shm write;
                       pickling its per-rank nested lists instead is measured
                       after the step and reported beside it
  areno_plain_free     train_step, --no-overlap-rewards, free reward
  areno_overlap_5ms    overlap, --reward-ms per sample
  areno_plain_5ms      no overlap, --reward-ms per sample

Checks (recorded in the JSON; exit status 1 if any fails), on the packs the
ranks received: every field of every rank's share and its micro-batch plan
identical (SHA-256) with and without overlap, for both reward costs; the same
between the reference and areno but for the advantages, whose per-sequence
values agree to 1e-5.

Usage:
  python scripts/bench_longcot.py                        # 32 x 8 x 4096, ~5 min
  python scripts/bench_longcot.py --quick --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
for _p in (SCRIPTS.parent, SCRIPTS):  # areno, and the helper modules beside this script
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchlib import (  # noqa: E402
    check_finite, cpu_in, fill_defaults, loadavg, proc_kb, reset_peak_rss, union_in, write_json,
)
from longcot_ranks import HOOKS_SPEC, MICRO_LIMIT_ENV, PROBE_DIR_ENV, RankLog, rank_figures  # noqa: E402
from longcot_ref import ref_train_step  # noqa: E402
from longcot_report import evaluate_targets, format_report  # noqa: E402
from longcot_sim import REWARD_COST_ENV, REWARD_PLUGIN, SyntheticEngine, set_reward_cost, write_dataset  # noqa: E402

from areno.backend.hooks import RANK_HOOKS_ENV  # noqa: E402
from areno.trainer import PhaseTimer, train_step  # noqa: E402

MODES = {
    # key: (label, kind, overlap, reward cost)
    "areno_overlap_free": ("areno, overlap, free reward", "areno", True, "free"),
    "reference_free": ("list reference, free reward", "reference", False, "free"),
    "areno_plain_free": ("areno, no overlap, free reward", "areno", False, "free"),
    "areno_overlap_5ms": ("areno, overlap, R ms reward", "areno", True, "cost"),
    "areno_plain_5ms": ("areno, no overlap, R ms reward", "areno", False, "cost"),
}
WARMUP = ("areno_overlap_free", "reference_free")
# (a, b): advantages and pack must be identical between modes a and b, same round.
IDENTICAL = (("areno_overlap_free", "areno_plain_free"), ("areno_overlap_5ms", "areno_plain_5ms"))
# The controller's own phases on the critical path (the hand-off is the backend's).
HOST_PHASES = ("decode", "reward", "advantages", "pack", "merge")


# -- one step ------------------------------------------------------------------------
def measure_step(run: Any, mode: str, step: int, ranks: RankLog) -> dict:
    """Run one step of `mode` and return its figures (see the module docstring)."""
    kind = MODES[mode][1]
    gc.collect()
    peak_ok = reset_peak_rss()
    rss0, load = proc_kb("VmRSS"), os.getloadavg()[0]
    timer = PhaseTimer(keep_spans=True)
    t_step = time.monotonic()
    if kind == "areno":
        m = train_step(run, step, timer)
    else:
        pickled = ref_train_step(run, timer)
    t_end = time.monotonic()
    hwm = proc_kb("VmHWM") if peak_ok else 0
    extra = {"train_time_metric_s": m.get("time/train", float("nan"))} if kind == "areno" else pickled()
    row = {"step": step, **controller_figures(timer.spans, run.engine.timeline, t_step, t_end)}
    row.update(rss_peak_mb=hwm / 1024 if peak_ok else float("nan"), rss_start_mb=rss0 / 1024,
               rss_growth_mb=(hwm - rss0) / 1024 if peak_ok else float("nan"), loadavg_1m=load)
    recs = ranks.new()
    if [len(r) for r in recs] != [1] * run.world_size:
        raise RuntimeError(f"rank probes: expected one record per rank for the step, got {[len(r) for r in recs]} "
                           f"(is ARENO_RANK_HOOKS reaching the ranks?)")
    row.update(rank_figures([r[0] for r in recs], run.engine.timeline["t_sleep"]), **extra)
    if kind == "reference":
        row["critical_pickled_s"] = row["critical_s"] - row["crit_handoff_s"] + extra["pickle_s"]
    return row


def controller_figures(spans: list, eng: dict, t_step: float, t_end: float) -> dict:
    """The controller's figures of one step from its PhaseTimer spans and the
    engine's timeline (generation; sleep/wake around backend.train; their timings)."""
    lt = eng["train"]
    t_gen_end, t_enter = eng["t_gen_end"], eng["t_sleep"]
    check = max(0.0, (eng["t_wake"] - t_enter) - lt["total_s"])  # the input check before the write
    t_hand = t_enter + check + lt["handoff_write_s"]
    crit = t_hand - t_gen_end

    def phase(name: str, lo: float = t_gen_end, hi: float = t_hand) -> float:
        return union_in([(a, z) for p, a, z, _ in spans if p == name], lo, hi)

    row = {"critical_s": crit, **{f"crit_{p}_s": phase(p) for p in HOST_PHASES}}
    row["crit_handoff_s"] = union_in([(t_enter, t_hand)], t_gen_end, t_hand)
    row["crit_other_s"] = max(0.0, crit - sum(row[f"crit_{p}_s"] for p in (*HOST_PHASES, "handoff")))
    row.update(
        crit_cpu_s=cpu_in(spans, HOST_PHASES, t_gen_end, t_hand),
        decode_total_s=sum(z - a for p, a, z, _ in spans if p == "decode"),
        reward_total_s=phase("reward", t_step, t_end),
        gen_time_s=t_gen_end - eng["t_start"],
        rollout_late_s=max(0.0, eng.get("t_exhausted", t_gen_end) - t_gen_end),
        stream_parts=eng.get("parts", 1),
        handoff_write_s=lt["handoff_write_s"], handoff_check_s=check,
        train_s=lt["total_s"] - lt["handoff_write_s"], rank_train_s=lt["train_s"],
        export_s=eng["export"].get("export_s", 0.0),
        host_outside_s=max(0.0, eng["t_start"] - t_step) + max(0.0, t_end - eng["t_update_weights"]),
        step_s=t_end - t_step,
    )
    return row


def summarize(rows: list[dict]) -> dict:
    """Median of every numeric field over the rounds."""
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = float(np.median(np.asarray(vals, dtype=np.float64)))
    return out


# -- the run -------------------------------------------------------------------------
def bench_config(args: argparse.Namespace, tmp: Path) -> tuple[Any, Path]:
    """The Run's TrainConfig (dataset, reward plugin and probe dirs in tmp) and the
    reward cost file; sets the environment the reward workers and ranks read."""
    from areno.config import TrainConfig
    from areno.tiny import tiny_model_path

    probe_dir = tmp / "probes"
    probe_dir.mkdir()
    cost_file = tmp / "reward_cost"
    set_reward_cost(cost_file, 0.0, args.reward_busy)
    os.environ.update({PROBE_DIR_ENV: str(probe_dir), MICRO_LIMIT_ENV: str(args.train_micro),
                       REWARD_COST_ENV: str(cost_file), RANK_HOOKS_ENV: HOOKS_SPEC})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as open_run's engine setup does
    plugin, data = tmp / "longcot_reward.py", tmp / "prompts.jsonl"
    plugin.write_text(REWARD_PLUGIN)
    write_dataset(data, args.prompts, args.prompt_words, args.seed)
    cfg = TrainConfig.from_sources(overrides=dict(
        ckpt=str(tiny_model_path("chat")), dataset_path=str(data), reward_fn_path=str(plugin),
        chat_template=True, max_prompt_len=1024, max_new_tokens=args.max_new_tokens, batch_size=args.prompts,
        n_samples=args.samples, world_size=args.world_size, device="cpu",
        reward_workers=args.reward_workers, reward_timeout=120.0, max_steps=10_000, epochs=10_000,
        output_dir=str(tmp / "run"), no_save=True, lr=1e-6, max_tokens_per_micro=args.max_tokens_per_micro,
        overlap_rewards=True, seed=args.seed,
    ))
    return cfg, cost_file


def run_rounds(run: Any, args: argparse.Namespace, cost_file: Path) -> tuple[dict, dict]:
    """Round 0 (warm-up: WARMUP modes), then args.steps rounds of every mode, each
    round replaying the same prompts in every mode. -> (rows per mode, warm-up rows)."""
    ranks = RankLog(Path(os.environ[PROBE_DIR_ENV]), run.world_size)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    warm: dict[str, dict] = {}
    state = run.sampler.state_dict()
    for rnd in range(args.steps + 1):
        for mode in [m for m in MODES if m in WARMUP] if rnd == 0 else MODES:
            _, _, overlap, cost = MODES[mode]
            run.sampler.load_state_dict(state)
            run.cfg.overlap_rewards = overlap
            set_reward_cost(cost_file, args.reward_ms if cost == "cost" else 0.0, args.reward_busy)
            row = measure_step(run, mode, rnd, ranks)
            if rnd:
                rows[mode].append(row)
            else:
                warm[mode] = row
            print(f"  round {rnd}{' (warm-up)' if not rnd else ''} {mode:<20} critical "
                  f"{row['critical_s'] * 1e3:8.1f} ms  reward {row['crit_reward_s'] * 1e3:7.1f} ms  "
                  f"handoff {row['handoff_ready_s'] * 1e3:6.1f} ms  wait {row['first_wait_s'] * 1e3:6.2f} ms"
                  f"  train {row['train_s']:6.1f} s  step {row['step_s']:6.1f} s  load {row['loadavg_1m']:.1f}",
                  flush=True)
        state = run.sampler.state_dict()
    return rows, warm


def run_bench(args: argparse.Namespace) -> dict:
    from areno.run import open_run

    t_start, load_start = time.monotonic(), loadavg()
    cfg, cost_file = bench_config(args, Path(tempfile.mkdtemp(prefix="bench_longcot_")))
    engine = SyntheticEngine(n=args.samples, resp_len=args.resp_len, max_new_tokens=args.max_new_tokens,
                             vocab=(3, 0), gen_time_s=args.gen_time, seed=args.seed)
    with open_run(cfg, engine=engine) as run:
        t_setup = time.monotonic() - t_start
        engine.vocab = (3, min(len(run.tokenizer), run.backend.vocab_size))  # 0..2: special tokens
        engine.timings_source = run.backend
        total_tokens = engine.prepare(run.prompts)
        gc.collect()
        gc.freeze()  # startup objects out of the collector's view (favours the reference)
        print(f"setup {t_setup:.1f} s: {args.prompts} prompts x {args.samples} samples, {total_tokens:,} "
              f"response tokens per step, world size {run.world_size}, gen time {args.gen_time:g} s, "
              f"reward {args.reward_ms:g} ms/sample ({'busy' if args.reward_busy else 'sleep'}) "
              f"x {args.reward_workers} workers, train micro-batches per rank per optimizer step: "
              f"{args.train_micro or 'all'}", flush=True)
        rows, warm = run_rounds(run, args, cost_file)
        # ru_maxrss is reset with VmHWM by clear_refs: take the max over the steps too
        lifetime_peak_mb = max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
                               + [r["rss_peak_mb"] for rs in [*rows.values(), list(warm.values())] for r in rs])
        meta = {"world_size": run.world_size, "strategy": run.backend.strategy, "model": cfg.ckpt,
                "response_tokens_per_step": total_tokens, "setup_s": t_setup}
    gc.unfreeze()
    checks = identity_checks(rows, args.steps)
    summary = {m: summarize(rows[m]) for m in MODES}
    for m in MODES:
        summary[m]["readback_sites"] = sorted({s for r in rows[m] for s in r.get("readback_sites", [])})
    for r in [r for rs in rows.values() for r in rs] + list(warm.values()):
        r.pop("_digests", None)
        r.pop("_seq_adv", None)
    meta.update(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv), quick=bool(args.quick),
        args={k: v for k, v in vars(args).items() if k != "out"}, runtime_s=time.monotonic() - t_start,
        loadavg_start=load_start, loadavg_end=loadavg(), controller_lifetime_peak_rss_mb=lifetime_peak_mb,
        python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
        cpu_count=os.cpu_count(), machine=platform.machine(),
        tokenizers_parallelism=os.environ.get("TOKENIZERS_PARALLELISM"),
        gc="enabled; gc.collect() before each step; startup objects frozen (gc.freeze)",
        aggregate="median over the measured rounds (round 0 is a warm-up, reported separately)",
    )
    out = {"meta": meta,
           "modes": {m: {"label": MODES[m][0].replace("R ms", f"{args.reward_ms:g} ms"),
                         "median": summary[m], "steps": rows[m]} for m in MODES},
           "warmup": warm, "checks": checks}
    out["targets"] = evaluate_targets(out)
    return out


# -- checks --------------------------------------------------------------
def identity_checks(rows: dict[str, list[dict]], steps: int) -> dict:
    """Same-round comparisons of the packs the ranks received (see the docstring)."""
    out: dict = {}

    def differ(ra: dict, rb: dict, skip: str | None = None) -> list[str]:
        return [f for f, h in ra["_digests"].items()
                if rb["_digests"].get(f) != h and not (skip and f.endswith(skip))]

    for a, b in IDENTICAL:
        diffs = [{"round": ra["step"], "fields": d} for ra, rb in zip(rows[a], rows[b]) if (d := differ(ra, rb))]
        out[f"identical:{a}=={b}"] = {"pass": not diffs and len(rows[a]) == steps, "differences": diffs}
    diffs = []
    for ra, rr in zip(rows["areno_plain_free"], rows["reference_free"]):
        d = differ(ra, rr, skip=".advantages")
        if len(ra["_seq_adv"]) != len(rr["_seq_adv"]) or not np.allclose(ra["_seq_adv"], rr["_seq_adv"],
                                                                         rtol=1e-5, atol=1e-5):
            d.append("per-sequence advantages (beyond 1e-5)")
        if d:
            diffs.append({"round": ra["step"], "fields": d})
    out["reference_equals_areno (advantages to 1e-5)"] = {"pass": not diffs, "differences": diffs}
    return out


# -- CLI -----------------------------------------------------------------------------
QUICK = dict(prompts=4, samples=4, resp_len=128, gen_time=0.3, max_tokens_per_micro=1024, train_micro=1, steps=1)
FULL = dict(prompts=32, samples=8, resp_len=4096, gen_time=4.0, max_tokens_per_micro=8192, train_micro=1, steps=5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, one round: a smoke test (~1 min)")
    ap.add_argument("--prompts", type=int, help="prompts per step (default 32; quick 4)")
    ap.add_argument("--samples", type=int, help="samples per prompt (default 8; quick 4)")
    ap.add_argument("--resp-len", type=int, help="mean response tokens (default 4096; quick 128)")
    ap.add_argument("--max-new-tokens", type=int, help="response length cap (default 2 x --resp-len)")
    ap.add_argument("--prompt-words", type=int, default=60, help="words per synthetic prompt (default 60)")
    ap.add_argument("--gen-time", type=float,
                    help="simulated generation seconds per step: the longest group finishes then "
                         "(default 4; quick 0.3)")
    ap.add_argument("--reward-ms", type=float, default=5.0, help="reward cost per sample in the R ms modes")
    ap.add_argument("--reward-busy", action="store_true", help="busy-wait the reward cost (default: sleep)")
    ap.add_argument("--reward-workers", type=int, default=2, help="reward worker processes (default 2)")
    ap.add_argument("--world-size", type=int, default=2, help="backend CPU ranks (default 2)")
    ap.add_argument("--max-tokens-per-micro", type=int, help="micro-batch token budget (default 8192; quick 1024)")
    ap.add_argument("--train-micro", type=int,
                    help="micro-batches each rank trains per optimizer step, its last ones (0 = all; default 1)")
    ap.add_argument("--steps", type=int, help="measured rounds (default 5; quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_results/longcot.json"), help="JSON output path")
    args = ap.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    if args.max_new_tokens is None:
        args.max_new_tokens = 2 * args.resp_len
    if args.samples < 2 or args.prompts < 1 or args.resp_len < 2 or args.steps < 1 or args.world_size < 1:
        ap.error("need --samples >= 2, --prompts >= 1, --resp-len >= 2, --steps >= 1, --world-size >= 1")
    if args.world_size > args.prompts * args.samples:
        ap.error("--world-size exceeds the samples per step")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run_bench(args)
    print()
    print(format_report(out))
    write_json(args.out, out)
    print(f"wrote {args.out}")
    bad = check_finite(out)
    if bad:
        print(f"non-finite values in the JSON: {bad[:10]}")
    return 0 if all(c["pass"] for c in out["checks"].values()) and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
