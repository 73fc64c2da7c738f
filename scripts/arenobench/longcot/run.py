"""bench_longcot's run: the modes, one measured step, the rounds (their checks: report.py).
scripts/arenobench/longcot/cli.py (the CLI, and what is measured) calls `run_bench`.

Imported only by the bench's main process: the ranks and reward workers are
spawned, and spawn imports the main script in every child, so bench_longcot.py
itself stays light (no torch for the reward workers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from arenobench.lib import cpu_in, loadavg, proc_kb, reset_peak_rss, union_in
from arenobench.longcot.ranks import HOOKS_SPEC, MICRO_LIMIT_ENV, PROBE_DIR_ENV, RankLog, rank_figures
from arenobench.longcot.ref import ref_train_step
from arenobench.longcot.report import HIDDEN_SLACK_S, evaluate_targets, hidden_checks, identity_checks, summarize
from arenobench.longcot.sim import (ENGINE_SPEC_ENV, REWARD_COST_ENV, REWARD_PLUGIN, SyntheticEngine, set_reward_cost,
                         write_dataset, write_engine_spec)

from areno.backend.hooks import RANK_HOOKS_ENV
from areno.run import open_run
from areno.trainer import PhaseTimer, train_step

MODES = {
    # key: (label, kind, overlap, reward cost)
    "areno_overlap_free": ("areno, overlap, free reward", "areno", True, "free"),
    "reference_free": ("list reference, free reward", "reference", False, "free"),
    "areno_plain_free": ("areno, no overlap, free reward", "areno", False, "free"),
    "areno_overlap_5ms": ("areno, overlap, R ms reward", "areno", True, "cost"),
    "areno_plain_5ms": ("areno, no overlap, R ms reward", "areno", False, "cost"),
    # K = 1: a Run of its own (split placement), consecutive steps (run_async)
    "areno_async_free": ("areno, K = 1 (engine process), free", "async", True, "free"),
}
ASYNC = "areno_async_free"
SYNC = "areno_overlap_free"  # the synchronous mode K = 1's step is compared with
WARMUP = ("areno_overlap_free", "reference_free")
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
    row.update(rank_figures([r[0] for r in recs], train_span(timer.spans)[0]), **extra)
    if kind == "reference":
        row["critical_pickled_s"] = row["critical_s"] - row["crit_handoff_s"] + extra["pickle_s"]
    return row


def train_span(spans: list) -> tuple[float, float]:
    """(start, end) of the step's "train" phase: what brackets backend.train."""
    (a, z), = [(a, z) for p, a, z, _ in spans if p == "train"]
    return a, z


def controller_figures(spans: list, eng: dict, t_step: float, t_end: float) -> dict:
    """The controller's figures of one step from its PhaseTimer spans and the
    engine's timeline (generation; the weight sync; the train's and sync's timings)."""
    lt = eng["train"]
    t_gen_end, (t_enter, t_exit) = eng["t_gen_end"], train_span(spans)
    check = max(0.0, (t_exit - t_enter) - lt["total_s"])  # the input check before the write
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
        export_s=eng["export"].get("publish_s", 0.0),
        host_outside_s=max(0.0, eng["t_start"] - t_step) + max(0.0, t_end - eng["t_update_weights"]),
        step_s=t_end - t_step,
    )
    return row


# -- the run -------------------------------------------------------------------------
def long_context_model(src: Path, dst: Path, positions: int) -> Path:
    """A copy of the tiny model whose config allows `positions` tokens (RoPE runs
    at any length; the synthetic engine never asks the model for text), so the
    full size's 2 x 4,096-token cap passes areno's context check."""
    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 0)), positions)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


def bench_config(args: argparse.Namespace, tmp: Path, k1: bool = False) -> tuple[Any, Path]:
    """The Run's TrainConfig (dataset, reward plugin and probe dirs in tmp) and the
    reward cost file; sets the environment the reward workers and ranks read.
    k1: the K = 1 mode's Run (split placement: one engine process, one step ahead),
    with its own probe dir."""
    from areno.config.train import TrainConfig
    from areno.models.tiny import tiny_model_path

    probe_dir = tmp / ("probes_k1" if k1 else "probes")
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
        ckpt=str(long_context_model(tiny_model_path("chat"), tmp / "model", 1024 + args.max_new_tokens)),
        dataset_path=str(data), reward_fn_path=str(plugin),
        chat_template=True, max_prompt_len=1024, max_new_tokens=args.max_new_tokens, batch_size=args.prompts,
        n_samples=args.samples, world_size=args.world_size, device="cpu",
        reward_workers=args.reward_workers, reward_timeout=120.0, max_steps=10_000, epochs=10_000,
        output_dir=str(tmp / ("run_k1" if k1 else "run")), no_save=True, lr=1e-6,
        max_tokens_per_micro=args.max_tokens_per_micro, overlap_rewards=True, seed=args.seed,
        # K = 1: the engine process builds the real engine for the weights, and
        # ProcEngine around it (ranks.LongcotRankHooks.make_engine)
        **(dict(rollout_world_size=1, off_policy_steps=1, rollout_engine="hf") if k1 else {}),
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
        for mode in [m for m in MODES if m in WARMUP] if rnd == 0 else [m for m in MODES if m != ASYNC]:
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
    """Every round of every mode in one Run -> the JSON (meta, modes, warm-up, checks, targets)."""
    t_start, load_start = time.monotonic(), loadavg()
    cfg, cost_file = bench_config(args, Path(tempfile.mkdtemp(prefix="bench_longcot_")))
    engine = SyntheticEngine(n=args.samples, resp_len=args.resp_len, max_new_tokens=args.max_new_tokens,
                             vocab=(3, 0), gen_time_s=args.gen_time, seed=args.seed)
    tmp = Path(cfg.output_dir).parent
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
    rows[ASYNC], warm[ASYNC] = run_async(args, tmp, cost_file)
    lifetime_peak_mb = max([lifetime_peak_mb] + [r["rss_peak_mb"] for r in rows[ASYNC] + [warm[ASYNC]]])
    checks = identity_checks(rows, args.steps)
    checks.update(hidden_checks(rows[ASYNC], args.steps, bool(args.quick)))
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


# -- K = 1 ----------------------------------------------------------------------------
class SnapTimer(PhaseTimer):
    """PhaseTimer(keep_spans=True) that copies the backend's public last_timings
    as the weight sync phase begins (the train call's) and ends (the publish's):
    what SyntheticEngine.sync_weights copies in the synchronous modes."""

    def __init__(self, backend: Any) -> None:
        super().__init__(keep_spans=True)
        self.backend, self.snaps = backend, {"train": {}, "export": {}}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase == "weight_sync":
            self.snaps["train"] = dict(self.backend.last_timings)
        with super().__call__(phase):
            yield
        if phase == "weight_sync":
            self.snaps["export"] = dict(self.backend.last_timings)


def measure_async_step(run: Any, step: int, ranks: RankLog) -> dict:
    """One step of the K = 1 loop (trainer.train_step). The controller's
    critical work is its window from the batch whole (the end of the collect's
    wait) to the hand-off written: the same phases as the synchronous modes' critical path.
    The figures of the rollout generated meanwhile (step + 1's) are added by
    run_async once it is done (add_inflight)."""
    gc.collect()
    peak_ok = reset_peak_rss()
    rss0, load = proc_kb("VmRSS"), os.getloadavg()[0]
    timer = SnapTimer(run.backend)
    t_step = time.monotonic()
    m = train_step(run, step, timer)
    t_end = time.monotonic()
    hwm = proc_kb("VmHWM") if peak_ok else 0
    spans = timer.spans
    # The rollout's parts were decoded and scored as they streamed in, during the
    # step before or the wait for it (add_streamed): the critical window opens when
    # the batch is whole, at the end of that wait.
    decodes = sorted((a, z) for p, a, z, _ in spans if p == "decode")
    t_host = t_step + m["time/wait_batch"]
    (t_pub,) = [z for p, _, z, _ in spans if p == "weight_sync"]
    eng = {"t_gen_end": t_host, "t_start": t_step, "train": timer.snaps["train"], "export": timer.snaps["export"],
           "t_update_weights": t_pub}
    row = {"step": step, **controller_figures(spans, eng, t_step, t_end)}
    row.update(take_s=t_host - t_step, wait_batch_s=m["time/wait_batch"], wait_weights_s=m["time/wait_weights"],
               step_metric_s=m["time/step"], train_time_metric_s=m.get("time/train", float("nan")),
               _t_hand=t_host + row["critical_s"], _t_pub=t_pub, _t_step=t_step, _decodes=decodes,
               _scored_end=decodes[-1][1])
    row.update(rss_peak_mb=hwm / 1024 if peak_ok else float("nan"), rss_start_mb=rss0 / 1024,
               rss_growth_mb=(hwm - rss0) / 1024 if peak_ok else float("nan"), loadavg_1m=load)
    recs = ranks.new()
    if [len(r) for r in recs] != [1] * run.world_size:
        raise RuntimeError(f"rank probes: expected one record per rank for the step, got {[len(r) for r in recs]}")
    row.update(rank_figures([r[0] for r in recs], train_span(spans)[0]))
    return row


def add_inflight(row: dict, nxt: dict) -> None:
    """Step k's row + the timeline of rollout k + 1 (generated while k was scored
    and trained): its generation, and by how much the controller's work ended
    before it (margins > 0: hidden)."""
    t_hand, t_pub = row.pop("_t_hand"), row.pop("_t_pub")
    row.update(gen_time_s=nxt["t_gen_end"] - nxt["t_start"], stream_parts=nxt.get("parts", 1),
               rollout_late_s=max(0.0, nxt.get("t_exhausted", nxt["t_gen_end"]) - nxt["t_gen_end"]),
               host_margin_s=nxt["t_gen_end"] - t_hand, step_margin_s=nxt["t_gen_end"] - t_pub,
               busy_s=t_pub - nxt["t_start"])
    row["hidden"] = row["host_margin_s"] >= -HIDDEN_SLACK_S
    row["step_hidden"] = row["step_margin_s"] >= -HIDDEN_SLACK_S


def add_streamed(row: dict, own: dict) -> None:
    """Step k's row + how its own rollout streamed in (issue 27, 2): the parts
    decoded and scored before its last completion came (the engine's t_gen_end),
    by how much the last of them ended before it (stream_margin_s > 0: decode
    and reward kept up with generation), and the scoring left after it (the
    last part's)."""
    decodes, t_last = row.pop("_decodes"), own["t_gen_end"]
    row.update(stream_parts_scored=len(decodes), parts_generated=own.get("parts", 1),
               stream_margin_s=t_last - max(z for _, z in decodes[:-1]) if len(decodes) > 1 else float("nan"),
               stream_after_last_s=max(0.0, row.pop("_scored_end") - t_last),
               stream_decode_total_s=sum(z - a for a, z in decodes))
    row["streamed"] = len(decodes) > 1 and row["stream_margin_s"] >= -HIDDEN_SLACK_S


def run_async(args: argparse.Namespace, tmp: Path, cost_file: Path) -> tuple[list[dict], dict]:
    """The K = 1 mode: a Run with one engine process one step ahead
    (--rollout-world-size 1 --off-policy-steps 1) whose engine is ProcEngine,
    prepared from the spec written here (the same responses and timeline as the
    synchronous modes'); step 1 (its rollout has nothing to hide behind) is the
    warm-up, then args.steps steps, then one more whose start ends the last
    one's period (step start to step start: the loop's cycle, the bench's own
    work between steps included). -> (rows, warm-up row)."""
    cfg, _ = bench_config(args, tmp, k1=True)
    set_reward_cost(cost_file, 0.0, args.reward_busy)
    spec, log = tmp / "engine_spec.json", tmp / "engine_rollouts.jsonl"
    os.environ[ENGINE_SPEC_ENV] = str(spec)  # read by the engine process (ranks.make_engine)
    try:
        with open_run(cfg) as run:
            ref = SyntheticEngine(n=args.samples, resp_len=args.resp_len, max_new_tokens=args.max_new_tokens,
                                  vocab=(3, min(len(run.tokenizer), run.backend.vocab_size)),
                                  gen_time_s=args.gen_time, seed=args.seed)
            write_engine_spec(spec, ref, run.prompts, ref.prepare(run.prompts), log)
            ranks = RankLog(Path(os.environ[PROBE_DIR_ENV]), run.world_size)
            rows = []
            for step in range(1, args.steps + 3):
                rows.append(measure_async_step(run, step, ranks))
                r = rows[-1]
                print(f"  K=1 step {step}{' (warm-up)' if step == 1 else ''}: host {r['critical_s'] * 1e3:7.1f} ms"
                      f"  train {r['train_s']:5.2f} s  publish {r['export_s'] * 1e3:6.1f} ms  wait_batch "
                      f"{r['wait_batch_s'] * 1e3:7.1f} ms  step {r['step_s']:5.2f} s  load {r['loadavg_1m']:.1f}",
                      flush=True)
            run.rollouts.ready_for_eval()  # the rollouts in flight, collected: the last step's margins
    finally:
        os.environ.pop(ENGINE_SPEC_ENV, None)
    rollouts = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    if len(rollouts) != len(rows) + 2:  # and the two in flight after the last step: k+1's and k+2's
        raise RuntimeError(f"K = 1: {len(rollouts)} rollouts logged by the engine process for {len(rows)} steps")
    starts = [row.pop("_t_step") for row in rows]
    for i, row in enumerate(rows):  # rollouts[k - 1] is step k's, rollouts[k] the one generated during k
        add_inflight(row, rollouts[row["step"]])
        add_streamed(row, rollouts[row["step"] - 1])
        if i + 1 < len(rows):  # the last (extra) step only ends the period of the one before
            row["period_s"] = starts[i + 1] - starts[i]
            row["bench_gap_s"] = row["period_s"] - row["step_s"]
    return rows[1:-1], rows[0]
