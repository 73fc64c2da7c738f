#!/usr/bin/env python
"""Host materialization: a list-based reference vs areno's array path, one process.

What is measured (same synthetic rollouts for both paths, outputs checked equal):

  advantages   GRPO group advantages. Reference: group rewards into per-group
               Python lists, one np.mean/np.std call per group, a Python loop
               per response. areno: `group_advantages` (bincount, no loops).
  pack         prompt ++ response packed back to back (input_ids, targets,
               position_ids, loss_mask, old_logprobs, advantages, seq_index).
               Reference: per-sample Python lists (`prompt + response`, masks as
               lists of 0/1, `[adv] * len`), concatenated, then torch.tensor.
               areno: `build_train_pack`.
  split        the same pack split over 2 data-parallel ranks. Reference: the
               same plan (areno's O(sequences) `plan_split`), then a list pack
               per rank. areno: `build_split_pack(world_size=2)`.
  padded       one right-padded row per sequence. Reference: per-sample lists
               copied row by row into torch.full tensors. areno:
               `build_padded_pack(...)`.
  stats        rollout log-prob count/mean/std/min/max. Reference: the per-sample
               lists flattened into one list, then numpy over it. areno:
               `StreamingStats.update` on the flat array.
  e2e          decode + advantages + pack. Reference: `tokenizer.decode` per
               sample + list advantages + list pack. areno: `decode_completions`
               (one batched call) + `group_advantages` + `build_train_pack`.
  memcpy       a baseline, not a pair: one np.copyto of as many bytes as the
               pack's per-token tensors hold, between two preallocated, already
               touched buffers (and, for information, a copy into a fresh
               allocation, which pays the page faults a new pack also pays).

The list reference and the equality checks live in scripts/arenobench/listref.py (shared
with bench_longcot.py); timing and output helpers in scripts/arenobench/lib.py.

Both paths start from their native rollout form (the reference from Python lists
as an engine returns them, areno from a RolloutBatch); building those is not
timed. Each timed run is one call (or the mean of k calls for runs shorter than
--min-run-time), with gc.collect() before and the garbage collector DISABLED
during the run (this favours the reference, whose lists would otherwise trigger
collections). Reference and areno runs alternate; medians are reported.

Usage:
  python scripts/bench_materialize.py                  # full sizes, 7 repeats
  python scripts/bench_materialize.py --quick --repeats 1 --out /tmp/m.json
  python scripts/bench_materialize.py --ref main       # this checkout against main, ratio per workload
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from arenobench.lib import (
    SPECIALS, Pairs, build_tokenizer, fmt_k, loadavg, median, target, target_lines, write_json,
)
from arenobench.listref import (
    PAD_ID, ListRollouts, compare_advantages, compare_e2e, compare_pack, compare_padded, compare_split,
    compare_stats, ref_advantages, ref_e2e, ref_pack, ref_padded, ref_split_pack, ref_stats, to_lists,
)

from arenobench.nearlimit import nl_advantages, nl_pack, nl_padded

from areno.advantages import group_advantages
from areno.pack import PACKED_TOKEN_FIELDS, TrainPack, Workspace, build_padded_pack, build_train_pack
from areno.rollout.batch import RolloutBatch, decode_completions, offsets_from_lengths
from areno.split import build_split_pack
from areno.stats import StreamingStats


# -- synthetic data ----------------------------------------------------------------
@dataclass
class Data:
    """One set of rollouts in both forms (areno's arrays, the reference's lists)."""

    batch: RolloutBatch
    rewards: np.ndarray  # [N] float64
    lists: ListRollouts

    @property
    def response_tokens(self) -> int:
        return self.batch.num_response_tokens


def make_data(seed: int, num_prompts: int, group_size: int, prompt_len: tuple[int, int],
              resp_len: tuple[int, int], vocab: tuple[int, int], *, empty_every: int = 0) -> Data:
    """Random rollouts: lengths uniform in the given inclusive ranges, token ids
    uniform in [vocab[0], vocab[1]), log-probs negative, rewards 0/1 with some
    constant groups. empty_every > 0 makes every k-th response empty."""
    rng = np.random.default_rng(seed)
    P, G = num_prompts, group_size
    N = P * G
    p_len = rng.integers(prompt_len[0], prompt_len[1] + 1, P).astype(np.int64)
    r_len = rng.integers(resp_len[0], resp_len[1] + 1, N).astype(np.int64)
    if empty_every:
        r_len[::empty_every] = 0
    T = int(r_len.sum())
    prompt_ids = rng.integers(vocab[0], vocab[1], int(p_len.sum()), dtype=np.int64).astype(np.int32)
    response_ids = rng.integers(vocab[0], vocab[1], T, dtype=np.int64).astype(np.int32)
    logprobs = (-rng.exponential(0.8, T)).astype(np.float32)
    rewards = (rng.random(N) < 0.5).astype(np.float64)
    rewards[: 2 * G] = np.repeat([0.0, 1.0], G)[: min(2 * G, N)]  # two constant groups
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_offsets=offsets_from_lengths(p_len), response_ids=response_ids,
        response_offsets=offsets_from_lengths(r_len), response_logprobs=logprobs,
        group_index=np.repeat(np.arange(P, dtype=np.int64), G), finish_reason=np.zeros(N, dtype=np.uint8),
    )
    return Data(batch, rewards, to_lists(batch, rewards))


def make_group_rewards(seed: int, num_groups: int, group_size: int, *, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """[N] rewards and [N] group ids; ragged: group sizes 1..2*group_size."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * group_size + 1, num_groups) if ragged else np.full(num_groups, group_size)
    g = np.repeat(np.arange(num_groups, dtype=np.int64), sizes)
    r = rng.choice([0.0, 0.5, 1.0], g.size)
    r[: int(sizes[0])] = 1.0  # a constant group
    return r, g


# -- areno's path ------------------------------------------------------------------
def areno_stats(batch: RolloutBatch) -> StreamingStats:
    s = StreamingStats()
    s.update(batch.response_logprobs)
    return s


def areno_e2e(tokenizer: Any, batch: RolloutBatch, rewards: np.ndarray, times: dict[str, float] | None = None):
    """decode + advantages + pack; times (when given) gets each part's seconds."""
    t0 = time.perf_counter()
    texts = decode_completions(tokenizer, batch)
    t1 = time.perf_counter()
    adv = group_advantages(rewards, batch.group_index, num_groups=batch.num_prompts)
    t2 = time.perf_counter()
    pack = build_train_pack(batch, adv)
    t3 = time.perf_counter()
    if times is not None:
        times.update(decode=t1 - t0, advantages=t2 - t1, pack=t3 - t2)
    return texts, adv, pack


def memcpy_fns(nbytes: int) -> dict[str, Callable[[], Any]]:
    """memcpy of `nbytes` between two preallocated, touched buffers (no page
    faults timed), and, for information, a copy into a fresh allocation."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return {"memcpy": lambda: np.copyto(dst, src), "fresh_copy": src.copy}


def pack_token_bytes(pack: TrainPack) -> int:
    return int(sum(getattr(pack, f).numpy().nbytes for f in PACKED_TOKEN_FIELDS))


# -- workloads ---------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    adv_groups: int
    adv_group_size: int
    adv_ragged: bool
    small: dict        # pack/split/padded "small" (~52K response tokens)
    large: dict        # pack/split/padded "large" and stats/e2e large (~1M)
    e2e_small: dict    # ~25K response tokens
    small_max_tokens: int
    large_max_tokens: int


FULL = Sizes(
    adv_groups=128, adv_group_size=16, adv_ragged=False,
    small=dict(num_prompts=32, group_size=8, prompt_len=(50, 150), resp_len=(100, 300)),
    large=dict(num_prompts=32, group_size=8, prompt_len=(150, 250), resp_len=(2048, 6144)),
    e2e_small=dict(num_prompts=32, group_size=8, prompt_len=(50, 150), resp_len=(50, 150)),
    small_max_tokens=4096, large_max_tokens=16384,
)
# Quick: tiny, and with the edge cases (1-token prompts and responses, empty
# responses, ragged and constant groups) so the equality checks mean something.
QUICK = Sizes(
    adv_groups=12, adv_group_size=4, adv_ragged=True,
    small=dict(num_prompts=5, group_size=3, prompt_len=(1, 6), resp_len=(1, 12), empty_every=4),
    large=dict(num_prompts=4, group_size=4, prompt_len=(10, 30), resp_len=(40, 200), empty_every=7),
    e2e_small=dict(num_prompts=3, group_size=4, prompt_len=(1, 8), resp_len=(1, 30), empty_every=5),
    small_max_tokens=16, large_max_tokens=256,
)

def time_advantages(pairs: Pairs, name: str, groups: int, sizes: Sizes) -> None:
    """group_advantages against the list and near-limit references."""
    r, g = make_group_rewards(4, groups, sizes.adv_group_size, ragged=sizes.adv_ragged)
    r_l, g_l, G = r.tolist(), g.tolist(), int(g.max()) + 1
    areno_fn = lambda: group_advantages(r, g, num_groups=G)  # noqa: E731
    near_limit(pairs, name, lambda: nl_advantages(r, g, G), areno_fn, compare_advantages,
               lambda nl: pairs.time(name, f"GRPO advantages {G} groups x ~{sizes.adv_group_size}", int(g.size),
                                     "response", lambda: ref_advantages(r_l, g_l), areno_fn, compare_advantages,
                                     baselines=nl))


def time_packs(pairs: Pairs, tag: str, d: Data, adv: np.ndarray, adv_l: list[float], max_tok: int) -> None:
    """pack (with its memcpy baseline), split over 2 ranks and padded, on one data set."""
    b, lr, T = d.batch, d.lists, d.response_tokens
    # areno's trainer keeps one Workspace for the run: steady-state steps
    # write into pages already mapped (see pack.Workspace).
    ws = Workspace()
    pack = build_train_pack(b, adv)
    extra = {"pack_tokens": pack.num_tokens, "sequences": pack.num_seqs, "pack_token_bytes": pack_token_bytes(pack)}
    areno_pack = lambda: build_train_pack(b, adv, workspace=ws)  # noqa: E731
    res = near_limit(pairs, f"pack_{tag}", lambda: nl_pack(b, adv), areno_pack, compare_pack,
                     lambda nl: pairs.time(f"pack_{tag}", f"train pack {fmt_k(T)} resp tok "
                                           f"({fmt_k(pack.num_tokens)} packed)", T, "response token",
                                           lambda: ref_pack(lr, adv_l), areno_pack, compare_pack,
                                           baselines={**memcpy_fns(extra["pack_token_bytes"]), **nl}, **extra))
    res["areno_over_memcpy"] = res["areno"]["median_s"] / res["memcpy"]["median_s"]
    res["areno_over_fresh_copy"] = res["areno"]["median_s"] / res["fresh_copy"]["median_s"]
    print(f"  {'memcpy':<13} {fmt_k(extra['pack_token_bytes']) + 'B (pack per-token bytes)':<40} "
          f"prealloc {res['memcpy']['median_s'] * 1e3:.3f} ms  fresh alloc "
          f"{res['fresh_copy']['median_s'] * 1e3:.3f} ms  -> pack = {res['areno_over_memcpy']:.1f}x memcpy",
          flush=True)
    pairs.time(f"split_{tag}", f"split pack ws=2 {fmt_k(T)} resp tok", T, "response token",
               lambda: ref_split_pack(lr, adv_l, 2, max_tok),
               lambda: build_split_pack(b, adv, world_size=2, max_tokens=max_tok, workspace=ws),
               compare_split, world_size=2, max_tokens=max_tok, **extra)
    areno_padded = lambda: build_padded_pack(b, adv, pad_id=PAD_ID)  # noqa: E731
    near_limit(pairs, f"padded_{tag}", lambda: nl_padded(b, adv, PAD_ID), areno_padded, compare_padded,
               lambda nl: pairs.time(f"padded_{tag}", f"padded [S, Lmax] {fmt_k(T)} resp tok", T,
                                     "response token", lambda: ref_padded(lr, adv_l), areno_padded,
                                     compare_padded, baselines=nl, **extra))


def near_limit(pairs: Pairs, name: str, nl_fn: Callable[[], Any], areno_fn: Callable[[], Any],
               compare: Callable[[Any, Any], list[str]], timed: Callable[[dict], dict[str, Any]]) -> dict[str, Any]:
    """Check the near-limit reference's output against areno's, run `timed`
    (a pairs.time call given {"nearlimit": nl_fn} as extra baselines, so all
    three alternate), and add areno / near-limit to its result."""
    pairs.failures.extend(f"{name} (near-limit): {e}" for e in compare(nl_fn(), areno_fn()))
    res = timed({"nearlimit": nl_fn})
    res["areno_over_nearlimit"] = res["areno"]["median_s"] / res["nearlimit"]["median_s"]
    print(f"  {'':<13} near-limit {res['nearlimit']['median_s'] * 1e3:.3f} ms -> areno = "
          f"{res['areno_over_nearlimit']:.2f}x near-limit", flush=True)
    return res


def time_e2e(pairs: Pairs, tag: str, d: Data, tok: Any) -> None:
    """decode + advantages + pack, and the median of each of areno's parts."""
    comp: list[dict[str, float]] = []

    def areno_fn() -> tuple:
        times: dict[str, float] = {}
        out = areno_e2e(tok, d.batch, d.rewards, times)
        comp.append(times)
        return out

    res = pairs.time(f"e2e_{tag}", f"decode+adv+pack {fmt_k(d.response_tokens)} resp tok", d.response_tokens,
                     "response token", lambda: ref_e2e(tok, d.lists), areno_fn, compare_e2e)
    timed = comp[-pairs.repeats * res["areno"]["calls_per_run"]:]  # drop the check and warm-up calls
    parts = {k: median([c[k] for c in timed]) for k in ("decode", "advantages", "pack")}
    parts["non_decode"] = median([c["advantages"] + c["pack"] for c in timed])
    res["areno_components_median_s"] = parts
    print(f"  {'':<13} areno: decode {parts['decode'] * 1e3:.3f} ms, advantages+pack "
          f"{parts['non_decode'] * 1e3:.3f} ms")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start, load_start = time.perf_counter(), loadavg()
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(1)  # both paths are single-threaded host code
    tok = build_tokenizer(args.vocab)
    ids = (len(SPECIALS), len(tok))  # ordinary tokens only
    small, large = make_data(1, vocab=ids, **sizes.small), make_data(2, vocab=ids, **sizes.large)
    e2e_small = make_data(3, vocab=ids, **sizes.e2e_small)
    packs = []
    for tag, d, max_tok in (("small", small, sizes.small_max_tokens), ("large", large, sizes.large_max_tokens)):
        adv = group_advantages(d.rewards, d.batch.group_index, num_groups=d.batch.num_prompts)
        packs.append((tag, d, adv, adv.tolist(), max_tok))
    # Everything built so far (imports, tokenizer, inputs) lives for the whole
    # run: move it out of the collector's view so gc.collect() between runs
    # stays cheap (it walks only the garbage of the previous run).
    gc.collect()
    gc.freeze()
    pairs = Pairs(args.repeats, args.min_run_time)
    print(f"tokenizer: byte-level BPE, {len(tok)} tokens; repeats {args.repeats}; "
          f"{'quick' if args.quick else 'full'} sizes")
    for tag, groups in (("", sizes.adv_groups), ("_large", 8 * sizes.adv_groups)):
        time_advantages(pairs, "advantages" + tag, groups, sizes)
    for tag, d, adv, adv_l, max_tok in packs:
        time_packs(pairs, tag, d, adv, adv_l, max_tok)
    pairs.time("stats", f"log-prob stats over {fmt_k(large.response_tokens)} values", large.response_tokens,
               "response token", lambda: ref_stats(large.lists.logprobs), lambda: areno_stats(large.batch),
               compare_stats)
    for tag, d in (("small", e2e_small), ("large", large)):
        time_e2e(pairs, tag, d, tok)
    return {"meta": meta(args, len(tok), load_start, t_start), "workloads": pairs.results,
            "targets": evaluate_targets(pairs.results), "equality_failures": pairs.failures,
            "near_limit_targets": [target(f"{name}: areno / near-limit", r["areno_over_nearlimit"], "<=", 1.5)
                                   for name, r in pairs.results.items() if "areno_over_nearlimit" in r]}


def meta(args: argparse.Namespace, vocab_size: int, load_start: list[float], t_start: float) -> dict[str, Any]:
    return {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "quick": bool(args.quick), "repeats": args.repeats, "min_run_time_s": args.min_run_time,
        "timer": "time.perf_counter; median over repeats; runs shorter than min_run_time "
                 "average several calls (calls_per_run)",
        "gc": "gc.collect() before each run, gc disabled during it",
        "tokenizer_vocab": vocab_size, "python": platform.python_version(), "numpy": np.__version__,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "thread_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                      "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")},
        "loadavg_start": load_start, "loadavg_end": loadavg(), "runtime_s": time.perf_counter() - t_start,
    }


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    t = []
    for tag in ("small", "large"):
        p = results[f"pack_{tag}"]
        t.append(target(f"pack_{tag}: reference / areno", p["ratio"], ">=", 40.0))
        t.append(target(f"pack_{tag}: areno / memcpy (same bytes)", p["areno_over_memcpy"], "<", 3.0))
    t.append(target("advantages: reference / areno", results["advantages"]["ratio"], ">=", 40.0))
    t.append(target("stats: reference / areno", results["stats"]["ratio"], ">=", 20.0))
    for tag in ("small", "large"):
        c = results[f"e2e_{tag}"]["areno_components_median_s"]
        t.append(target(f"e2e_{tag}: areno non-decode / decode", c["non_decode"] / c["decode"], "<", 1.0))
    return t


def format_report(out: dict[str, Any]) -> str:
    lines = []
    hdr = (f"{'workload':<13} {'what':<40} {'ref med':>10} {'areno med':>10} {'ratio':>8} {'ratio(min)':>10} "
           f"{'ref us/u':>9} {'areno us/u':>10}  unit")
    lines.append(hdr)
    lines.append("-" * len(hdr))

    def ms(s: float) -> str:
        return f"{s * 1e3:.3f}ms" if s < 10 else f"{s:.2f}s"

    for name, r in out["workloads"].items():
        lines.append(
            f"{name:<13} {r['label']:<40} {ms(r['reference']['median_s']):>10} {ms(r['areno']['median_s']):>10} "
            f"{r['ratio']:>7.1f}x {r['ratio_of_mins']:>9.1f}x {r['reference_us_per_unit']:>9.4f} "
            f"{r['areno_us_per_unit']:>10.4f}  {r['unit']}"
            + ("" if r["outputs_equal"] else "  OUTPUTS DIFFER")
        )
    lines.append("")
    for name in ("pack_small", "pack_large"):
        r = out["workloads"][name]
        lines.append(
            f"{name}: {r['pack_tokens']} packed tokens, {r['pack_token_bytes']} per-token bytes; memcpy "
            f"{r['memcpy']['median_s'] * 1e3:.3f} ms (prealloc), {r['fresh_copy']['median_s'] * 1e3:.3f} ms "
            f"(fresh); pack = {r['areno_over_memcpy']:.2f}x memcpy, {r['areno_over_fresh_copy']:.2f}x fresh copy"
        )
    for name, r in out["workloads"].items():
        if "areno_over_nearlimit" in r:
            lines.append(f"{name}: near-limit {r['nearlimit']['median_s'] * 1e3:.3f} ms; areno / near-limit "
                         f"{r['areno_over_nearlimit']:.2f}x, list reference / near-limit "
                         f"{r['reference']['median_s'] / r['nearlimit']['median_s']:.1f}x")
    for name in ("e2e_small", "e2e_large"):
        c = out["workloads"][name]["areno_components_median_s"]
        lines.append(
            f"{name}: areno decode {c['decode'] * 1e3:.3f} ms, advantages {c['advantages'] * 1e3:.3f} ms, "
            f"pack {c['pack'] * 1e3:.3f} ms"
        )
    lines.append("")
    quick = out["meta"]["quick"]
    lines.append("targets:" + ("  (quick sizes: not meaningful, shown as n/a)" if quick else ""))
    lines += target_lines(out["targets"] + out["near_limit_targets"], quick, 42, "9.2f")
    m = out["meta"]
    lines.append("")
    lines.append("ratio = reference median / areno median; ratio(min) = the same with each path's fastest run; "
                 "us/u = median microseconds per unit")
    lines.append(f"{m['gc']}; {m['timer']}")
    la0, la1 = m["loadavg_start"], m["loadavg_end"]
    lines.append(f"load average (1 min) {la0[0]:.2f} at start, {la1[0]:.2f} at end, on {m['cpu_count']} CPUs; "
                 f"runtime {m['runtime_s']:.1f} s")
    if out["equality_failures"]:
        lines.append("OUTPUT MISMATCHES (reference vs areno):")
        lines += [f"  {e}" for e in out["equality_failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per path (median reported; default 7)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes with edge cases: a smoke test")
    ap.add_argument("--out", type=Path, default=Path("bench_results/materialize.json"), help="JSON output path")
    ap.add_argument("--min-run-time", type=float, default=0.005,
                    help="runs shorter than this many seconds average several calls (default 0.005)")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size to train (default 2048)")
    ap.add_argument("--ref", metavar="REV", help="run REV's bench (a git worktree) and this checkout's in turn "
                    "and print areno's time ratio per workload (this checkout / REV)")
    ap.add_argument("--ref-rounds", type=int, default=2, help="with --ref: runs of each tree (default 2)")
    args = ap.parse_args(argv)
    if args.ref:
        from arenobench.materialize_ref import against_ref
        return against_ref(args)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not 300 <= args.vocab <= 65536:
        ap.error("--vocab must lie in [300, 65536]")
    out = run(args)
    print()
    print(format_report(out))
    write_json(args.out, out)
    print(f"wrote {args.out}")
    return 1 if out["equality_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
