"""The list-based reference: the host work of a trainer that holds rollouts as
per-sample Python lists (the shape most trainers use today), and the checks
that it computes exactly what areno's array path computes.

Used by scripts/arenobench/materialize.py (function by function) and
scripts/arenobench/longcot/ (wired into the real loop). A ratio against this
reference only means something if the outputs are equal, so every benchmark
compares them (compare_*) before timing.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areno.pack import PACKED_TOKEN_FIELDS, TrainPack
from areno.rollout.batch import RolloutBatch
from areno.split import SplitPack, plan_split
from areno.stats import StreamingStats

EPS = 1e-6
PAD_ID = 0
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


@dataclass
class ListRollouts:
    """The reference's input: what a list-based trainer holds after sampling."""

    prompts: list[list[int]]       # per unique prompt
    responses: list[list[int]]     # per sample
    logprobs: list[list[float]]    # per sample, one float per response token
    group_of: list[int]            # per sample: its prompt
    rewards: list[float]           # per sample


def to_lists(batch: RolloutBatch, rewards: np.ndarray) -> ListRollouts:
    """The reference's form of a RolloutBatch (not timed: an engine returns it)."""
    ro = batch.response_offsets
    return ListRollouts(
        prompts=[batch.prompt_tokens(p).tolist() for p in range(batch.num_prompts)],
        responses=[batch.response_ids[ro[i] : ro[i + 1]].tolist() for i in range(batch.num_responses)],
        logprobs=[batch.response_logprobs[ro[i] : ro[i + 1]].tolist() for i in range(batch.num_responses)],
        group_of=batch.group_index.tolist(),
        rewards=np.asarray(rewards, dtype=np.float64).tolist(),
    )


# -- the reference -------------------------------------------------------------
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


def ref_sequence_lists(
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
    fields, cu = ref_sequence_lists(lr, adv, order, seq_base)
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

# -- equality checks (the reference must compute what areno computes) --------------
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
