"""The list reference of scripts/arenobench/listref.py wired into bench_longcot's loop:
`ref_train_step` has train_step's shape (rollout, decode, reward, advantages,
pack, backend.train, weight export) in the same Run (same engine, reward
workers and backend ranks), with a list-based trainer's host work:
per-sample decode, per-group advantages, per-sample list pack -> torch.tensor
over the same split plan, handed off by the same shared-memory write (the
ranks only take shm). What pickling its per-rank nested lists would cost
instead, as a list-based trainer ships them, is measured after the step.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable

import numpy as np
import torch
from arenobench.listref import ListRollouts, ref_advantages, ref_decode, ref_pack, ref_sequence_lists, ref_stats

from areno.pack import PACKED_TOKEN_FIELDS, TrainPack
from areno.data.prompts import select
from areno.rewards import RewardRecord
from areno.rollout.batch import FINISH_REASONS
from areno.split import SplitPack, plan_split
from areno.trainer import PhaseTimer


def ref_reward_records(run: Any, prompt_idx: np.ndarray, lr: ListRollouts, texts: list[str],
                       finish: list[int]) -> list[RewardRecord]:
    """One RewardRecord per sample, from the reference's lists."""
    rows, prompts = run.rows, run.prompts
    out = []
    for i, (g, text) in enumerate(zip(lr.group_of, texts)):
        p = int(prompt_idx[g])
        row = rows[int(prompts.row_index[p])]
        out.append(RewardRecord(
            prompt=prompts.texts[p], completion=text, answer=row.get("answer"),
            solutions=row.get("solutions"), row=row, num_tokens=len(lr.responses[i]),
            finish_reason=FINISH_REASONS[finish[i]], index=i,
        ))
    return out


def ref_build_split(lr: ListRollouts, adv: list[float], world_size: int, max_tokens: int) -> tuple[SplitPack, list[int]]:
    """listref's list pack (per-sample lists -> torch.tensor) over the same split
    plan as areno (plan_split is O(sequences)), as one SplitPack so the real
    backend can take it; token-mean weights 1 / (loss tokens). Also returns the
    sample order."""
    used = [i for i, r in enumerate(lr.responses) if r]
    lengths = [len(lr.prompts[lr.group_of[i]]) + len(lr.responses[i]) - 1 for i in used]
    plan = plan_split(np.asarray(lengths, dtype=np.int64), world_size, max_tokens)
    order = [used[j] for j in plan.seq_order.tolist()]
    d = ref_pack(lr, adv, order)
    weight = 1.0 / max(sum(len(lr.responses[i]) for i in used), 1)
    pack = TrainPack(**{f: d[f] for f in PACKED_TOKEN_FIELDS}, cu_seqlens=d["cu_seqlens"],
                     seq_weights=torch.tensor([weight] * len(order), dtype=torch.float32),
                     sample_index=d["sample_index"])
    return SplitPack(pack, plan), order


def ref_pickled_handoff(lr: ListRollouts, adv: list[float], split: SplitPack, order: list[int]) -> dict[str, float]:
    """What a list-based trainer ships instead of the shm write: per rank, its
    share as per-field Python lists, pickled (controller side only; measured
    after the step, not sent)."""
    per_rank = []
    for r in range(split.world_size):
        a, b = split.rank_seq_range(r)
        per_rank.append(ref_sequence_lists(lr, adv, order[a:b], seq_base=a)[0])
    t0 = time.monotonic()
    blobs = [pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL) for x in per_rank]
    return {"pickle_s": time.monotonic() - t0, "pickle_bytes": sum(len(b) for b in blobs)}


def ref_train_step(run: Any, timer: PhaseTimer) -> Callable[[], dict[str, float]]:
    """One step of the list reference, timed with the phases train_step uses.
    Returns the measurement of its pickled hand-off (ref_pickled_handoff), for the
    caller to run once the step's clock has stopped."""
    cfg = run.cfg
    prompt_idx = run.sampler.next_batch()
    ids, offsets = select(run.prompts, prompt_idx)
    lr, finish = run.engine.generate_lists(ids, offsets, cfg.n_samples)
    with timer("decode"):
        texts = ref_decode(run.tokenizer, lr.responses)
    with timer("reward"):
        scored = run.scorer.score(ref_reward_records(run, prompt_idx, lr, texts, finish))
        rewards = scored.rewards.tolist()
    with timer("materialize"):
        with timer.span("advantages"):
            adv = ref_advantages(rewards, lr.group_of).tolist()
        with timer.span("pack"):
            split, order = ref_build_split(lr, adv, run.world_size, cfg.max_tokens_per_micro)
    with timer("train"):
        run.backend.train(split)
    with timer("weight_sync"):
        run.engine.sync_weights()
    ref_stats(lr.logprobs)  # the reference's rollout log-prob statistics
    return lambda: ref_pickled_handoff(lr, adv, split, order)
