"""bench_longcot's probes inside the backend's rank processes, through areno's
RankHooks (areno/backend/hooks.py): the bench sets ARENO_RANK_HOOKS to
"arenobench.longcot.ranks:LongcotRankHooks" and every rank builds one at startup (spawned
ranks inherit the controller's environment). Per train command
each rank appends one JSON record to PROBE_DIR/rank<r>.jsonl:

  first wait   a 1-element all_reduce just before the first forward (where
               FSDP2's first all-gather would be): first_arrive/first_done on
               time.monotonic; a second one right after it gives the
               collective's own latency with the ranks in step (second_s); the
               rank's work before it (map + device copies of every
               micro-batch) in wall and thread CPU time (prep_cpu_s).
  readbacks    Tensor.item/tolist/cpu calls from the first forward to the
               reply, with call sites (arenobench.lib.ReadbackCounter, a torch
               function mode). It starts after the device copies: under the
               mode every torch call pays a Python dispatch, which doubled the
               map + copy time the prep figures measure (0.65 -> 1.24 ms for 10
               micro-batches); those copies make no readback by design (host
               ints from the pack), which tests/test_backend_units.py pins over
               the whole command.
  compute      with MICRO_LIMIT_ENV = k > 0 each optimizer step trains only the
               last k micro-batches of its mini-batch (the smallest: the planner
               packs first-fit decreasing); the whole pack is still mapped and
               copied to the device.
  the engine   in the engine process of the K = 1 mode (split placement),
               make_engine builds sim.ProcEngine around the real
               engine cfg.engine names, when ENGINE_SPEC_ENV is set.
  the pack     SHA-256 of every field of the rank's share and of its micro-batch
               plan, and the mean advantage of each sequence: the controller
               checks the packs modes hand off against each other. Hashed after
               training, before the reply (off the measured figures but for
               the step's wall time).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from arenobench.lib import ReadbackCounter
from arenobench.longcot.sim import ENGINE_SPEC_ENV

from areno.backend.handoff import LocalPack
from areno.backend.hooks import RankHooks
from areno.pack import TrainPack

PROBE_DIR_ENV = "ARENO_BENCH_LONGCOT_PROBE_DIR"
MICRO_LIMIT_ENV = "ARENO_BENCH_LONGCOT_MICRO_LIMIT"
HOOKS_SPEC = "arenobench.longcot.ranks:LongcotRankHooks"  # the value of ARENO_RANK_HOOKS


class LongcotRankHooks(RankHooks):
    """Built in each rank from ARENO_RANK_HOOKS; see the module docstring."""

    def __init__(self) -> None:
        self.out_dir = Path(os.environ[PROBE_DIR_ENV])
        self.micro_limit = int(os.environ.get(MICRO_LIMIT_ENV, "0"))
        self.rec: dict = {}
        self.counter: ReadbackCounter | None = None

    def make_engine(self, cfg, device):
        spec = os.environ.get(ENGINE_SPEC_ENV)
        if not spec:
            return None
        from areno.rollout.factory import make_engine
        from arenobench.longcot.sim import ProcEngine

        inner, kind = make_engine(cfg.engine, cfg.model_path, device)
        return ProcEngine(inner, Path(spec)), f"synthetic({kind})"

    def train_begin(self, rank: int) -> None:
        self.rec = {"rank": rank, "t_enter": time.monotonic(), "first_arrive": None}
        self.cpu_enter = time.thread_time()
        self.counter = ReadbackCounter()

    def before_update(self, micros: list[list]) -> list[list]:
        rec = self.rec
        rec["prep_cpu_s"] = time.thread_time() - self.cpu_enter
        x = torch.zeros(1)
        rec["first_arrive"] = time.monotonic()
        second = (0.0, 0.0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(x)
            rec["first_done"] = time.monotonic()
            dist.all_reduce(x)  # baseline: the same collective with the ranks already in step
            second = (rec["first_done"], time.monotonic())
        else:
            rec["first_done"] = time.monotonic()
        rec["second_s"] = second[1] - second[0]
        rec["num_minibatches"], rec["num_micro"] = len(micros), len(micros[0]) if micros else 0
        self.counter.__enter__()  # left in train_end
        k = self.micro_limit
        return [row[-k:] for row in micros] if k > 0 else micros

    def train_end(self, rank: int, local: LocalPack, reply: dict) -> None:
        rec, steps = self.rec, reply["steps"]
        if rec["first_arrive"] is not None:  # before_update entered the counter
            self.counter.__exit__(None, None, None)
        else:  # no micro-batch reached the trainer
            rec.update(first_arrive=rec["t_enter"], first_done=rec["t_enter"], second_s=0.0, prep_cpu_s=0.0,
                       num_micro=0, num_minibatches=0)
        rec.update(map_s=reply["map_s"], train_s=reply["train_s"], readbacks=self.counter.calls,
                   opt_steps=len(steps), micro_limit=self.micro_limit,
                   step_time_s=[s.get("step_time_s", 0.0) for s in steps],
                   num_tokens=[s.get("num_tokens", 0.0) for s in steps], **pack_record(local))
        with open(self.out_dir / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def pack_record(local: LocalPack) -> dict:
    """Digests of a rank's share (every TrainPack field, the micro-batch plan),
    each sequence's mean advantage over its loss tokens, and token counts."""
    p: TrainPack = local.pack
    digests = {f.name: hashlib.sha256(getattr(p, f.name).numpy().tobytes()).hexdigest() for f in fields(p)}
    digests["micro_seqs"] = hashlib.sha256(np.ascontiguousarray(local.micro_seqs).tobytes()).hexdigest()
    cu = p.cu_seqlens.numpy().astype(np.int64)
    mask = p.loss_mask.numpy()
    seq_adv: list[float] = []
    if cu.size > 1 and p.num_tokens:
        starts = cu[:-1] - cu[0]  # every sequence has >= 1 position: starts increase strictly
        s = np.add.reduceat(np.where(mask, p.advantages.numpy(), 0).astype(np.float64), starts)
        n = np.add.reduceat(mask.astype(np.int64), starts)
        seq_adv = (s / np.maximum(n, 1)).tolist()
    return {"digests": digests, "seq_adv": seq_adv, "pack_tokens": p.num_tokens,
            "response_tokens": int(mask.sum())}


class RankLog:
    """Reads the rank probes' JSONL files incrementally (controller side)."""

    def __init__(self, directory: Path, world_size: int) -> None:
        self.paths = [directory / f"rank{r}.jsonl" for r in range(world_size)]
        self.pos = [0] * world_size

    def new(self) -> list[list[dict]]:
        """Per rank, the records written since the last call."""
        out = []
        for r, p in enumerate(self.paths):
            recs = []
            if p.exists():
                with open(p) as f:
                    f.seek(self.pos[r])
                    data = f.read()
                    self.pos[r] += len(data)
                recs = [json.loads(line) for line in data.splitlines() if line.strip()]
            out.append(recs)
        return out


def rank_figures(per_rank: list[dict], t_train_call: float) -> dict:
    """One step's rank figures from one record per rank; t_train_call: when the
    controller called backend.train (time.monotonic)."""
    arrive = [r["first_arrive"] for r in per_rank]
    opt_steps = per_rank[0]["opt_steps"]
    readbacks = max(len(r["readbacks"]) for r in per_rank)
    return {
        "first_wait_s": max(r["first_done"] - r["first_arrive"] for r in per_rank),
        "rank_arrival_skew_s": max(arrive) - min(arrive),
        "collective_baseline_s": max(r["second_s"] for r in per_rank),
        "rank_prep_s": max(r["first_arrive"] - r["t_enter"] for r in per_rank),
        "rank_prep_cpu_s": max(r["prep_cpu_s"] for r in per_rank),
        "handoff_ready_s": max(r["t_enter"] + r["map_s"] for r in per_rank) - t_train_call,
        "opt_steps": opt_steps,
        "readbacks": readbacks,
        "readbacks_per_opt_step": readbacks / max(1, opt_steps),
        "readback_sites": sorted(set(s for r in per_rank for s in r["readbacks"])),
        "micro_batches_per_rank": per_rank[0]["num_micro"] * per_rank[0]["num_minibatches"],
        "micro_limit": per_rank[0]["micro_limit"],
        "rank_tokens_trained": [sum(r["num_tokens"]) for r in per_rank],
        "pack_tokens": sum(r["pack_tokens"] for r in per_rank),
        "response_tokens": sum(r["response_tokens"] for r in per_rank),
        "_digests": {f"rank{r['rank']}.{k}": v for r in per_rank for k, v in r["digests"].items()},
        "_seq_adv": [a for r in per_rank for a in r["seq_adv"]],
    }
