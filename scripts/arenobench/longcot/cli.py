#!/usr/bin/env python
"""Long-CoT step benchmark: the real trainer loop at ~1M response tokens per step,
with a synthetic rollout engine and the real backend on CPU ranks, against the
list-based reference of scripts/arenobench/listref.py wired into the same loop.

What runs (one process tree, one run):

  controller  `open_run(cfg, engine=SyntheticEngine(...))` with the tiny "chat"
              model, a JSONL dataset of P prompts and a reward plugin written to
              a temp dir; then `areno.trainer.train_step` (the real step:
              rollout, decode, reward, advantages, pack, backend.train, weight
              export) for the areno modes, and ref.ref_train_step for
              the reference (same Run: same engine, reward workers, backend ranks).
  engine      sim.SyntheticEngine: precomputed responses, a modelled
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
              to the rank's device tensors (ranks.py).

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
(areno/backend/hooks.py) that ranks.py installs through ARENO_RANK_HOOKS.
Where the parts live: run.py (modes, one step, rounds),
sim.py (engine, reward, data), ranks.py, ref.py,
report.py (medians, checks, targets, tables), scripts/arenobench/lib.py and listref.py (shared).

Modes (one step of each per round, rounds repeated --steps times, after a
warm-up round; each round replays the same prompts in every mode):

  areno_overlap_free   train_step, --overlap-rewards (default), free reward
  reference_free       the list reference, handed off by the same shm write;
                       pickling its per-rank nested lists instead is measured
                       after the step and reported beside it
  areno_plain_free     train_step, --no-overlap-rewards, free reward
  areno_overlap_5ms    overlap, --reward-ms per sample
  areno_plain_5ms      no overlap, --reward-ms per sample
  areno_async_free     K = 1, a Run of its own after the others: split placement
                       (--rollout-world-size 1 --off-policy-steps 1, which turns
                       on --recompute-logprobs), trainer.train_step, free
                       reward; 1 warm-up step then --steps consecutive steps. The
                       synthetic engine runs in the engine process
                       (sim.ProcEngine, built there by the RankHooks'
                       make_engine, prepared from a spec file the controller
                       writes: the same responses and timeline; the weights go
                       into the real hf engine inside it, probe included).
                       The engine process streams each finished part and the
                       controller decodes and scores it as it comes, also while
                       the ranks train (issue 27, 2). Step k's figures: the
                       controller's critical work (the batch whole, at the end of
                       time/wait_batch -> hand-off written, by phase as above),
                       train,
                       publish, time/wait_batch and time/wait_weights, and the
                       generation of the rollout in flight (k+1's, from the
                       engine process's log) with margins: its end minus the end
                       of the host work, and of the publish.

Checks (recorded in the JSON; exit status 1 if any fails), on the packs the
ranks received: every field of every rank's share and its micro-batch plan
identical (SHA-256) with and without overlap, for both reward costs; the same
between the reference and areno but for the advantages, whose per-sequence
values agree to 1e-5. K = 1 "streamed": in every measured step the decode of
every part of rollout k but the last ends before its last completion
arrives (50 ms slack), so only the last part's decode and reward are left
after generation. K = 1 "hidden": in every measured step the host work
on step k ends before rollout k+1's generation does (50 ms slack); and with
train + publish too (required at full sizes; at --quick ones the tiny steps
train longer than the 0.3 s generation, reported as info).

Usage:
  python scripts/bench_longcot.py                        # 32 x 8 x 4096, ~4 min
  python scripts/bench_longcot.py --quick --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Nothing heavy at the top: the ranks and reward workers are spawned, and spawn
# imports the script that started the run in each of them; the bench itself
# lives in run.py.


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
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_new_tokens is None:
        args.max_new_tokens = 2 * args.resp_len
    if args.samples < 2 or args.prompts < 1 or args.resp_len < 2 or args.steps < 1 or args.world_size < 1:
        ap.error("need --samples >= 2, --prompts >= 1, --resp-len >= 2, --steps >= 1, --world-size >= 1")
    if args.world_size > args.prompts * args.samples:
        ap.error("--world-size exceeds the samples per step")
    return args


def main(argv: list[str] | None = None) -> int:
    from arenobench.lib import check_finite, write_json
    from arenobench.longcot.report import format_report
    from arenobench.longcot.run import run_bench

    args = parse_args(argv)
    out = run_bench(args)
    print()
    print(format_report(out))
    write_json(args.out, out)
    print(f"wrote {args.out}")
    bad = check_finite(out)
    if bad:
        print(f"non-finite values in the JSON: {bad[:10]}")
    return 0 if all(c["pass"] for c in out["checks"].values() if c.get("required", True)) and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
