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
               `build_train_pack(...).to_padded()`.
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

Both paths start from their native rollout form (the reference from Python lists
as an engine returns them, areno from a RolloutBatch); building those is not
timed. Each timed run is one call (or the mean of k calls for runs shorter than
--min-run-time), with gc.collect() before and the garbage collector DISABLED
during the run (this favours the reference, whose lists would otherwise trigger
collections). Reference and areno runs alternate; medians are reported.

Usage:
  python scripts/bench_materialize.py                  # full sizes, 7 repeats
  python scripts/bench_materialize.py --quick --repeats 1 --out /tmp/m.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from areno.advantages import group_advantages  # noqa: E402
from areno.pack import PACKED_TOKEN_FIELDS, TrainPack, Workspace, build_train_pack  # noqa: E402
from areno.rollout.batch import RolloutBatch, decode_completions, offsets_from_lengths  # noqa: E402
from areno.split import SplitPack, build_split_pack, plan_split  # noqa: E402
from areno.stats import StreamingStats  # noqa: E402

EPS = 1e-6
PAD_ID = 0
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# dtypes of the reference's torch tensors: the same as TrainPack's.
FIELD_DTYPES = {
    "input_ids": torch.int32,
    "targets": torch.int32,
    "position_ids": torch.int32,
    "loss_mask": torch.bool,
    "old_logprobs": torch.float32,
    "advantages": torch.float32,
    "seq_index": torch.int32,
}


# =============================================================================
# Synthetic data
# =============================================================================
@dataclass
class ListRollouts:
    """The reference's input: what a list-based trainer holds after sampling."""

    prompts: list[list[int]]       # per unique prompt
    responses: list[list[int]]     # per sample
    logprobs: list[list[float]]    # per sample, one float per response token
    group_of: list[int]            # per sample: its prompt
    rewards: list[float]           # per sample


@dataclass
class Data:
    batch: RolloutBatch
    rewards: np.ndarray  # [N] float64
    lists: ListRollouts

    @property
    def response_tokens(self) -> int:
        return self.batch.num_response_tokens


def make_data(
    seed: int,
    num_prompts: int,
    group_size: int,
    prompt_len: tuple[int, int],
    resp_len: tuple[int, int],
    vocab: tuple[int, int],
    *,
    empty_every: int = 0,
) -> Data:
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
    group_index = np.repeat(np.arange(P, dtype=np.int64), G)
    rewards = (rng.random(N) < 0.5).astype(np.float64)
    rewards[: 2 * G] = np.repeat([0.0, 1.0], G)[: min(2 * G, N)]  # two constant groups
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_offsets=offsets_from_lengths(p_len),
        response_ids=response_ids,
        response_offsets=offsets_from_lengths(r_len),
        response_logprobs=logprobs,
        group_index=group_index,
        finish_reason=np.zeros(N, dtype=np.uint8),
    )
    return Data(batch, rewards, to_lists(batch, rewards))


def to_lists(batch: RolloutBatch, rewards: np.ndarray) -> ListRollouts:
    ro = batch.response_offsets
    return ListRollouts(
        prompts=[batch.prompt_tokens(p).tolist() for p in range(batch.num_prompts)],
        responses=[batch.response_ids[ro[i] : ro[i + 1]].tolist() for i in range(batch.num_responses)],
        logprobs=[batch.response_logprobs[ro[i] : ro[i + 1]].tolist() for i in range(batch.num_responses)],
        group_of=batch.group_index.tolist(),
        rewards=np.asarray(rewards, dtype=np.float64).tolist(),
    )


def make_group_rewards(seed: int, num_groups: int, group_size: int, *, ragged: bool) -> tuple[np.ndarray, np.ndarray]:
    """[N] rewards and [N] group ids; ragged: group sizes 1..2*group_size."""
    rng = np.random.default_rng(seed)
    if ragged:
        sizes = rng.integers(1, 2 * group_size + 1, num_groups)
    else:
        sizes = np.full(num_groups, group_size)
    g = np.repeat(np.arange(num_groups, dtype=np.int64), sizes)
    r = rng.choice([0.0, 0.5, 1.0], g.size)
    first = int(sizes[0])
    r[:first] = 1.0  # a constant group
    return r, g


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE trained here on a synthetic corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1234)
    syll = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"] + ["th", "ng", "st", "qu"]
    words = ["".join(rng.choices(syll, k=rng.randint(1, 3))) for _ in range(3000)]
    digits = [str(rng.randrange(1000)) for _ in range(300)]
    vocab_words = words + digits + ["=", "+", "-", "*", "(", ")", ".", ",", "?", "####"]
    lines = [" ".join(rng.choices(vocab_words, k=rng.randint(5, 24))) for _ in range(6000)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


# =============================================================================
# The list-based reference (the shape most trainers use today)
# =============================================================================
def ref_advantages(rewards: list[float], group_of: list[int], eps: float = EPS) -> np.ndarray:
    """Group the rewards in per-group lists, one np.mean/np.std per group, a
    Python loop per response. A group of one gets 0 (as areno)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_of):
        by_group[g].append(r)
    mean: dict[int, float] = {}
    std: dict[int, float] = {}
    for g, rs in by_group.items():
        if len(rs) > 1:
            mean[g] = float(np.mean(rs))
            std[g] = float(np.std(rs, ddof=1))  # unbiased, as verl and TRL
        else:
            mean[g], std[g] = rs[0], math.inf  # -> advantage 0
    out = [(r - mean[g]) / (std[g] + eps) for r, g in zip(rewards, group_of)]
    return np.asarray(out, dtype=np.float32)


def _ref_sequence_lists(
    lr: ListRollouts, adv: list[float], order: list[int], seq_base: int = 0
) -> tuple[dict[str, list], list[int]]:
    """Per-sample Python lists, extended into one flat list per field."""
    input_ids: list[int] = []
    targets: list[int] = []
    position_ids: list[int] = []
    loss_mask: list[int] = []
    old_lp: list[float] = []
    advs: list[float] = []
    seq_index: list[int] = []
    cu = [0]
    for s, i in enumerate(order, start=seq_base):
        prompt = lr.prompts[lr.group_of[i]]
        resp = lr.responses[i]
        full = prompt + resp
        n = len(full) - 1
        n_prompt = len(prompt) - 1  # positions whose target is still a prompt token
        input_ids.extend(full[:-1])
        targets.extend(full[1:])
        position_ids.extend(range(n))
        loss_mask.extend([0] * n_prompt + [1] * len(resp))
        old_lp.extend([0.0] * n_prompt + lr.logprobs[i])
        advs.extend([0.0] * n_prompt + [adv[i]] * len(resp))
        seq_index.extend([s] * n)
        cu.append(cu[-1] + n)
    fields = {
        "input_ids": input_ids,
        "targets": targets,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "old_logprobs": old_lp,
        "advantages": advs,
        "seq_index": seq_index,
    }
    return fields, cu


def ref_pack(lr: ListRollouts, adv: list[float], order: list[int] | None = None, seq_base: int = 0) -> dict[str, torch.Tensor]:
    """List reference of build_train_pack: lists per sample, concatenated, torch.tensor."""
    if order is None:
        order = [i for i, r in enumerate(lr.responses) if r]
    fields, cu = _ref_sequence_lists(lr, adv, order, seq_base)
    out = {f: torch.tensor(v, dtype=FIELD_DTYPES[f]) for f, v in fields.items()}
    out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    out["sample_index"] = torch.tensor(order, dtype=torch.int64)
    return out


def ref_split_pack(lr: ListRollouts, adv: list[float], world_size: int, max_tokens: int) -> list[dict[str, torch.Tensor]]:
    """The same split plan as areno (plan_split is O(sequences)), then one list
    pack per rank; token-mean loss weights 1 / (loss tokens)."""
    used = [i for i, r in enumerate(lr.responses) if r]
    lengths = [len(lr.prompts[lr.group_of[i]]) + len(lr.responses[i]) - 1 for i in used]
    plan = plan_split(np.asarray(lengths, dtype=np.int64), world_size, max_tokens)
    order = [used[j] for j in plan.seq_order.tolist()]
    weight = 1.0 / max(sum(len(lr.responses[i]) for i in used), 1)
    ranks = []
    for r in range(world_size):
        a, b = int(plan.micro_seqs[r, 0, 0, 0]), int(plan.micro_seqs[r, -1, -1, 1])
        rank = ref_pack(lr, adv, order[a:b], seq_base=a)
        rank["seq_weights"] = torch.tensor([weight] * (b - a), dtype=torch.float32)
        ranks.append(rank)
    return ranks


def ref_padded(lr: ListRollouts, adv: list[float], pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """Per-sample lists, copied row by row into [S, Lmax] torch tensors."""
    order = [i for i, r in enumerate(lr.responses) if r]
    rows: dict[str, list[list]] = {f: [] for f in FIELD_DTYPES if f != "seq_index"}
    for i in order:
        prompt = lr.prompts[lr.group_of[i]]
        resp = lr.responses[i]
        full = prompt + resp
        n = len(full) - 1
        n_prompt = len(prompt) - 1
        rows["input_ids"].append(full[:-1])
        rows["targets"].append(full[1:])
        rows["position_ids"].append(list(range(n)))
        rows["loss_mask"].append([0] * n_prompt + [1] * len(resp))
        rows["old_logprobs"].append([0.0] * n_prompt + lr.logprobs[i])
        rows["advantages"].append([0.0] * n_prompt + [adv[i]] * len(resp))
    S = len(order)
    Lmax = max((len(r) for r in rows["input_ids"]), default=0)
    fill = {"input_ids": pad_id, "targets": pad_id, "position_ids": 0, "loss_mask": False,
            "old_logprobs": 0.0, "advantages": 0.0}
    out: dict[str, torch.Tensor] = {}
    for f, field_rows in rows.items():
        t = torch.full((S, Lmax), fill[f], dtype=FIELD_DTYPES[f])
        for s, row in enumerate(field_rows):
            t[s, : len(row)] = torch.tensor(row, dtype=FIELD_DTYPES[f])
        out[f] = t
    am = torch.zeros((S, Lmax), dtype=torch.bool)
    for s, row in enumerate(rows["input_ids"]):
        am[s, : len(row)] = True
    out["attention_mask"] = am
    return out


def ref_stats(logprobs: list[list[float]]) -> tuple[int, float, float, float, float]:
    """Flatten the per-sample lists into one list, then numpy over it. The list
    is converted once (np.asarray), the cheapest way to get all four numbers."""
    flat: list[float] = []
    for lp in logprobs:
        flat.extend(lp)
    arr = np.asarray(flat)
    return len(flat), float(np.mean(arr)), float(np.std(arr)), float(np.min(arr)), float(np.max(arr))


def ref_decode(tokenizer: Any, responses: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]


def ref_e2e(tokenizer: Any, lr: ListRollouts) -> tuple[list[str], np.ndarray, dict[str, torch.Tensor]]:
    texts = ref_decode(tokenizer, lr.responses)
    adv = ref_advantages(lr.rewards, lr.group_of)
    pack = ref_pack(lr, adv.tolist())
    return texts, adv, pack


# =============================================================================
# areno's path
# =============================================================================
def areno_stats(batch: RolloutBatch) -> StreamingStats:
    s = StreamingStats()
    s.update(batch.response_logprobs)
    return s


def areno_e2e(tokenizer: Any, batch: RolloutBatch, rewards: np.ndarray, times: dict[str, float] | None = None):
    t0 = time.perf_counter()
    texts = decode_completions(tokenizer, batch)
    t1 = time.perf_counter()
    adv = group_advantages(rewards, batch.group_index, num_groups=batch.num_prompts)
    t2 = time.perf_counter()
    pack = build_train_pack(batch, adv)
    t3 = time.perf_counter()
    if times is not None:
        times["decode"] = t1 - t0
        times["advantages"] = t2 - t1
        times["pack"] = t3 - t2
    return texts, adv, pack


# =============================================================================
# Equality checks (the reference must compute what areno computes)
# =============================================================================
def _cmp(name: str, ref: torch.Tensor, got: torch.Tensor, errors: list[str]) -> None:
    if ref.dtype != got.dtype:
        errors.append(f"{name}: dtype {ref.dtype} (reference) != {got.dtype} (areno)")
    elif ref.shape != got.shape:
        errors.append(f"{name}: shape {tuple(ref.shape)} (reference) != {tuple(got.shape)} (areno)")
    elif not torch.equal(ref, got):
        bad = int((ref != got).nonzero()[0][0]) if ref.dim() == 1 else -1
        errors.append(f"{name}: values differ (first at {bad})")


def compare_pack(ref: dict[str, torch.Tensor], pack: TrainPack, prefix: str = "") -> list[str]:
    errors: list[str] = []
    for f in (*PACKED_TOKEN_FIELDS, "cu_seqlens", "sample_index"):
        _cmp(prefix + f, ref[f], getattr(pack, f), errors)
    if "seq_weights" in ref:
        _cmp(prefix + "seq_weights", ref["seq_weights"], pack.seq_weights, errors)
    return errors


def compare_split(ref_ranks: list[dict[str, torch.Tensor]], sp: SplitPack) -> list[str]:
    errors: list[str] = []
    if len(ref_ranks) != sp.world_size:
        return [f"world_size {len(ref_ranks)} != {sp.world_size}"]
    for r, ref in enumerate(ref_ranks):
        a, b = sp.rank_seq_range(r)
        errors += compare_pack(ref, sp.pack.slice_seqs(a, b), prefix=f"rank{r}.")
    return errors


def compare_padded(ref: dict[str, torch.Tensor], padded: Any) -> list[str]:
    errors: list[str] = []
    for f in ("input_ids", "targets", "position_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages"):
        _cmp(f, ref[f], getattr(padded, f), errors)
    return errors


def compare_advantages(ref: np.ndarray, got: np.ndarray) -> list[str]:
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return [f"advantages: {ref.shape}/{ref.dtype} (reference) vs {got.shape}/{got.dtype} (areno)"]
    # Constant groups: the reference's mean of equal floats can be off by an
    # ulp (-> ~1e-11 after dividing by eps); areno returns exactly 0.
    if not np.allclose(ref, got, rtol=1e-5, atol=1e-5):
        i = int(np.flatnonzero(~np.isclose(ref, got, rtol=1e-5, atol=1e-5))[0])
        return [f"advantages: differ at {i}: {ref[i]} (reference) vs {got[i]} (areno)"]
    return []


def compare_stats(ref: tuple[int, float, float, float, float], s: StreamingStats) -> list[str]:
    count, mean, std, lo, hi = ref
    errors = []
    if count != s.count:
        errors.append(f"stats.count {count} != {s.count}")
    for name, a, b in (("mean", mean, s.mean), ("std", std, s.std)):
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            errors.append(f"stats.{name} {a!r} (reference) != {b!r} (areno)")
    if lo != s.min or hi != s.max:
        errors.append(f"stats.min/max ({lo}, {hi}) (reference) != ({s.min}, {s.max}) (areno)")
    return errors


def compare_e2e(ref: tuple, got: tuple) -> list[str]:
    errors = []
    if ref[0] != got[0]:
        bad = next((i for i, (a, b) in enumerate(zip(ref[0], got[0])) if a != b), -1)
        errors.append(f"decode: texts differ (first at response {bad}; counts {len(ref[0])}/{len(got[0])})")
    errors += compare_advantages(ref[1], got[1])
    if not errors:  # the packs only agree when the advantages do
        errors += compare_pack(ref[2], got[2])
    return errors


# =============================================================================
# Timing
# =============================================================================
def _run(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call: `inner` calls, gc collected before and off during."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    del out
    return dt / inner


def _inner_count(fn: Callable[[], Any], min_run_time: float) -> int:
    t = _run(fn, 1)  # also the warm-up call
    if t <= 0:
        return 1000
    return int(min(1000, max(1, math.ceil(min_run_time / t))))


def _median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, min_run_time: float) -> dict[str, Any]:
    """Round-robin over `fns` (reference, areno, ...): each gets `repeats` timed
    runs, interleaved so that a noisy neighbour hits all of them alike."""
    k = {name: _inner_count(fn, min_run_time) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_run(fn, k[name]))
    return {
        name: {"median_s": _median(ts), "min_s": float(min(ts)), "times_s": ts, "calls_per_run": k[name]}
        for name, ts in times.items()
    }


def memcpy_fns(nbytes: int) -> dict[str, Callable[[], Any]]:
    """memcpy of `nbytes` between two preallocated, touched buffers (no page
    faults timed), and, for information, a copy into a fresh allocation."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return {"memcpy": lambda: np.copyto(dst, src), "fresh_copy": src.copy}


def pack_token_bytes(pack: TrainPack) -> int:
    return int(sum(getattr(pack, f).numpy().nbytes for f in PACKED_TOKEN_FIELDS))


# =============================================================================
# Workloads
# =============================================================================
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

WORKLOADS = (
    "advantages", "pack_small", "pack_large", "split_small", "split_large",
    "padded_small", "padded_large", "stats", "e2e_small", "e2e_large",
)


def _loadavg() -> list[float]:
    try:
        return list(os.getloadavg())
    except OSError:
        return [math.nan] * 3


def _fmt_k(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else (f"{n / 1e3:.0f}K" if n >= 1e3 else str(n))


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = _loadavg()
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(1)  # both paths are single-threaded host code
    tok = build_tokenizer(args.vocab)
    vocab_size = len(tok)
    ids = (len(SPECIALS), vocab_size)  # ordinary tokens only

    small = make_data(1, vocab=ids, **sizes.small)
    large = make_data(2, vocab=ids, **sizes.large)
    e2e_small = make_data(3, vocab=ids, **sizes.e2e_small)
    adv_small = group_advantages(small.rewards, small.batch.group_index, num_groups=small.batch.num_prompts)
    adv_large = group_advantages(large.rewards, large.batch.group_index, num_groups=large.batch.num_prompts)
    adv_small_l, adv_large_l = adv_small.tolist(), adv_large.tolist()
    r_adv, g_adv = make_group_rewards(4, sizes.adv_groups, sizes.adv_group_size, ragged=sizes.adv_ragged)
    r_adv_l, g_adv_l = r_adv.tolist(), g_adv.tolist()
    n_groups_adv = int(g_adv.max()) + 1

    # Everything built so far (imports, tokenizer, inputs) lives for the whole
    # run: move it out of the collector's view so gc.collect() between runs
    # stays cheap (it walks only the garbage of the previous run).
    gc.collect()
    gc.freeze()

    results: dict[str, Any] = {}
    failures: list[str] = []

    def bench(name: str, label: str, units: int, unit: str, ref_fn, areno_fn, compare,
              baselines: dict[str, Callable] | None = None, **extra) -> None:
        errors = compare(ref_fn(), areno_fn())
        if errors:
            failures.extend(f"{name}: {e}" for e in errors)
        print(f"  {name:<13} {label:<40}", end="", flush=True)
        t = time_interleaved({"reference": ref_fn, "areno": areno_fn, **(baselines or {})},
                             args.repeats, args.min_run_time)
        ref_m, ar_m = t["reference"]["median_s"], t["areno"]["median_s"]
        results[name] = {
            "label": label,
            "unit": unit,
            "units": units,
            **t,
            "ratio": ref_m / ar_m if ar_m > 0 else math.inf,
            "ratio_of_mins": t["reference"]["min_s"] / t["areno"]["min_s"] if t["areno"]["min_s"] > 0 else math.inf,
            "reference_us_per_unit": ref_m / units * 1e6,
            "areno_us_per_unit": ar_m / units * 1e6,
            "outputs_equal": not errors,
            **extra,
        }
        print(f" ref {ref_m * 1e3:9.3f} ms  areno {ar_m * 1e3:8.3f} ms  x{ref_m / ar_m:7.1f}", flush=True)

    print(f"tokenizer: byte-level BPE, {vocab_size} tokens; repeats {args.repeats}; "
          f"{'quick' if args.quick else 'full'} sizes")

    # -- advantages ---------------------------------------------------------
    bench(
        "advantages", f"GRPO advantages {n_groups_adv} groups x ~{sizes.adv_group_size}",
        int(g_adv.size), "response",
        lambda: ref_advantages(r_adv_l, g_adv_l),
        lambda: group_advantages(r_adv, g_adv, num_groups=n_groups_adv),
        compare_advantages,
    )

    # -- pack / split / padded ---------------------------------------------
    for tag, d, adv, adv_l, max_tok in (
        ("small", small, adv_small, adv_small_l, sizes.small_max_tokens),
        ("large", large, adv_large, adv_large_l, sizes.large_max_tokens),
    ):
        b, lr, T = d.batch, d.lists, d.response_tokens
        # areno's trainer keeps one Workspace for the run: steady-state steps
        # write into pages already mapped (see pack.Workspace).
        ws = Workspace()
        pack = build_train_pack(b, adv)
        extra = {"pack_tokens": pack.num_tokens, "sequences": pack.num_seqs,
                 "pack_token_bytes": pack_token_bytes(pack)}
        bench(f"pack_{tag}", f"train pack {_fmt_k(T)} resp tok ({_fmt_k(pack.num_tokens)} packed)",
              T, "response token",
              lambda lr=lr, adv_l=adv_l: ref_pack(lr, adv_l),
              lambda b=b, adv=adv, ws=ws: build_train_pack(b, adv, workspace=ws),
              compare_pack, baselines=memcpy_fns(extra["pack_token_bytes"]), **extra)
        res = results[f"pack_{tag}"]
        res["areno_over_memcpy"] = res["areno"]["median_s"] / res["memcpy"]["median_s"]
        res["areno_over_fresh_copy"] = res["areno"]["median_s"] / res["fresh_copy"]["median_s"]
        print(f"  {'memcpy':<13} {_fmt_k(extra['pack_token_bytes']) + 'B (pack per-token bytes)':<40} "
              f"prealloc {res['memcpy']['median_s'] * 1e3:.3f} ms  fresh alloc "
              f"{res['fresh_copy']['median_s'] * 1e3:.3f} ms  -> pack = {res['areno_over_memcpy']:.1f}x memcpy",
              flush=True)
        bench(f"split_{tag}", f"split pack ws=2 {_fmt_k(T)} resp tok", T, "response token",
              lambda lr=lr, adv_l=adv_l, m=max_tok: ref_split_pack(lr, adv_l, 2, m),
              lambda b=b, adv=adv, m=max_tok, ws=ws: build_split_pack(
                  b, adv, world_size=2, max_tokens=m, workspace=ws),
              compare_split, world_size=2, max_tokens=max_tok, **extra)
        bench(f"padded_{tag}", f"padded [S, Lmax] {_fmt_k(T)} resp tok", T, "response token",
              lambda lr=lr, adv_l=adv_l: ref_padded(lr, adv_l),
              lambda b=b, adv=adv: build_train_pack(b, adv).to_padded(PAD_ID),
              compare_padded, **extra)

    # -- statistics ----------------------------------------------------------
    lb = large.batch
    bench("stats", f"log-prob stats over {_fmt_k(large.response_tokens)} values",
          large.response_tokens, "response token",
          lambda: ref_stats(large.lists.logprobs),
          lambda: areno_stats(lb),
          compare_stats)

    # -- end to end ------------------------------------------------------------
    for tag, d in (("small", e2e_small), ("large", large)):
        comp: list[dict[str, float]] = []

        def areno_fn(d=d, comp=comp):
            times: dict[str, float] = {}
            out = areno_e2e(tok, d.batch, d.rewards, times)
            comp.append(times)
            return out

        bench(f"e2e_{tag}", f"decode+adv+pack {_fmt_k(d.response_tokens)} resp tok",
              d.response_tokens, "response token",
              lambda d=d: ref_e2e(tok, d.lists), areno_fn, compare_e2e)
        res = results[f"e2e_{tag}"]
        k = res["areno"]["calls_per_run"]
        timed = comp[-args.repeats * k:]  # drop the check and warm-up calls
        dec = _median([c["decode"] for c in timed])
        non = _median([c["advantages"] + c["pack"] for c in timed])
        res["areno_components_median_s"] = {
            "decode": dec,
            "advantages": _median([c["advantages"] for c in timed]),
            "pack": _median([c["pack"] for c in timed]),
            "non_decode": non,
        }
        print(f"  {'':<13} areno: decode {dec * 1e3:.3f} ms, advantages+pack {non * 1e3:.3f} ms")

    targets = evaluate_targets(results)
    return {
        "meta": {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "quick": bool(args.quick),
            "repeats": args.repeats,
            "min_run_time_s": args.min_run_time,
            "timer": "time.perf_counter; median over repeats; runs shorter than min_run_time "
                     "average several calls (calls_per_run)",
            "gc": "gc.collect() before each run, gc disabled during it",
            "tokenizer_vocab": vocab_size,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "thread_env": {k: os.environ.get(k) for k in
                           ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS",
                            "TOKENIZERS_PARALLELISM")},
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
            "runtime_s": time.perf_counter() - t_start,
        },
        "workloads": results,
        "targets": targets,
        "equality_failures": failures,
    }


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    t: list[dict[str, Any]] = []

    def add(name: str, value: float, op: str, threshold: float) -> None:
        ok = value >= threshold if op == ">=" else value < threshold
        t.append({"target": name, "value": value, "op": op, "threshold": threshold, "pass": bool(ok)})

    for tag in ("small", "large"):
        p = results[f"pack_{tag}"]
        add(f"pack_{tag}: reference / areno", p["ratio"], ">=", 40.0)
        add(f"pack_{tag}: areno / memcpy (same bytes)", p["areno_over_memcpy"], "<", 3.0)
    add("advantages: reference / areno", results["advantages"]["ratio"], ">=", 40.0)
    add("stats: reference / areno", results["stats"]["ratio"], ">=", 20.0)
    for tag in ("small", "large"):
        c = results[f"e2e_{tag}"]["areno_components_median_s"]
        add(f"e2e_{tag}: areno non-decode / decode", c["non_decode"] / c["decode"], "<", 1.0)
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
    for name in ("e2e_small", "e2e_large"):
        c = out["workloads"][name]["areno_components_median_s"]
        lines.append(
            f"{name}: areno decode {c['decode'] * 1e3:.3f} ms, advantages {c['advantages'] * 1e3:.3f} ms, "
            f"pack {c['pack'] * 1e3:.3f} ms"
        )
    lines.append("")
    quick = out["meta"]["quick"]
    lines.append("targets:" + ("  (quick sizes: not meaningful, shown as n/a)" if quick else ""))
    for t in out["targets"]:
        verdict = "n/a " if quick else ("PASS" if t["pass"] else "FAIL")
        lines.append(f"  {verdict}  {t['target']:<42} {t['value']:9.2f} {t['op']} {t['threshold']:g}")
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


def write_json(path: Path, obj: Any) -> None:
    """Write to a temp file beside `path`, then rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per path (median reported; default 7)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes with edge cases: a smoke test")
    ap.add_argument("--out", type=Path, default=Path("bench_results/materialize.json"), help="JSON output path")
    ap.add_argument("--min-run-time", type=float, default=0.005,
                    help="runs shorter than this many seconds average several calls (default 0.005)")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size to train (default 2048)")
    args = ap.parse_args(argv)
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
