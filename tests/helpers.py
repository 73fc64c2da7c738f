"""Shared builders for tests: random RolloutBatches with varied shapes, and
reference transforms of RolloutBatch and TrainPack that only tests use."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from areno.advantages import zero_variance_groups
from areno.procs.segment import SHM_DIR, SHM_PREFIX
from areno.pack import PACKED_TOKEN_FIELDS, TrainPack, runs_index
from areno.rollout.batch import RolloutBatch, offsets_from_lengths
from areno.split import LossAgg, SplitPack, aggregation_weights, plan_split


@pytest.fixture(autouse=True)
def float64_default():
    """torch's default dtype float64 for each test of a module that imports this
    (autouse there): the losses' references are float64. Per test, not set at
    import, which leaked into every test collected after it."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def random_batch(
    seed: int = 0,
    num_prompts: int = 6,
    group_sizes: list[int] | None = None,
    max_prompt: int = 7,
    max_response: int = 9,
    min_response: int = 1,
    vocab: int = 100,
) -> RolloutBatch:
    """Groups of varied size, prompts and responses of varied length."""
    rng = np.random.default_rng(seed)
    if group_sizes is None:
        group_sizes = rng.integers(1, 5, num_prompts).tolist()
    P = len(group_sizes)
    p_len = rng.integers(1, max_prompt + 1, P)
    g = np.repeat(np.arange(P), group_sizes).astype(np.int64)
    N = g.size
    r_len = rng.integers(min_response, max_response + 1, N)
    T = int(r_len.sum())
    return RolloutBatch(
        prompt_ids=rng.integers(0, vocab, int(p_len.sum())).astype(np.int32),
        prompt_offsets=offsets_from_lengths(p_len),
        response_ids=rng.integers(0, vocab, T).astype(np.int32),
        response_offsets=offsets_from_lengths(r_len),
        response_logprobs=(-rng.random(T) * 3).astype(np.float32),
        group_index=g,
        finish_reason=rng.integers(0, 2, N).astype(np.uint8),
    )


def random_rewards(batch: RolloutBatch, seed: int = 0, zero_var_groups: int = 1) -> np.ndarray:
    """Binary-ish rewards; the first `zero_var_groups` groups are constant."""
    rng = np.random.default_rng(seed + 100)
    r = rng.choice([0.0, 0.5, 1.0], size=batch.num_responses)
    for p in range(min(zero_var_groups, batch.num_prompts)):
        r[batch.group_index == p] = 1.0
    return r.astype(np.float32)


# -- RolloutBatch transforms (the trainer uses RolloutBatch.merge_parts) ------


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """Concatenate batches; prompts of later batches are renumbered. O(batches) Python."""
    if not batches:
        raise ValueError("concat: no batches")
    if len(batches) == 1:
        return batches[0]
    p_shift = np.cumsum([0] + [b.num_prompts for b in batches[:-1]])
    pt_shift = np.cumsum([0] + [b.prompt_ids.size for b in batches[:-1]])
    rt_shift = np.cumsum([0] + [b.response_ids.size for b in batches[:-1]])
    return RolloutBatch(
        prompt_ids=np.concatenate([b.prompt_ids for b in batches]),
        prompt_offsets=np.concatenate(
            [np.zeros(1, np.int64)] + [b.prompt_offsets[1:] + s for b, s in zip(batches, pt_shift)]
        ).astype(np.int64),
        response_ids=np.concatenate([b.response_ids for b in batches]),
        response_offsets=np.concatenate(
            [np.zeros(1, np.int64)] + [b.response_offsets[1:] + s for b, s in zip(batches, rt_shift)]
        ).astype(np.int64),
        response_logprobs=np.concatenate([b.response_logprobs for b in batches]),
        group_index=np.concatenate([b.group_index + s for b, s in zip(batches, p_shift)]).astype(np.int64),
        finish_reason=np.concatenate([b.finish_reason for b in batches]),
    )


def take_prompts(batch: RolloutBatch, order: np.ndarray) -> tuple[RolloutBatch, np.ndarray]:
    """Reorder the groups so new prompt p is old prompt order[p] (order: a
    permutation [P]); responses follow their prompt, keeping their order
    within a group. Returns (batch, resp_perm) with resp_perm [N] the old
    index of each new response. One gather per array."""
    order = np.asarray(order, dtype=np.int64)
    if np.array_equal(order, np.arange(batch.num_prompts)):
        return batch, np.arange(batch.num_responses, dtype=np.int64)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    new_group = rank[batch.group_index]
    resp_perm = np.argsort(new_group, kind="stable")
    p_new, r_new = batch.prompt_lengths[order], batch.response_lengths[resp_perm]
    p_off, r_off = offsets_from_lengths(p_new), offsets_from_lengths(r_new)
    p_src = np.repeat(batch.prompt_offsets[:-1][order] - p_off[:-1], p_new) + np.arange(p_off[-1])
    r_src = np.repeat(batch.response_offsets[:-1][resp_perm] - r_off[:-1], r_new) + np.arange(r_off[-1])
    out = RolloutBatch(
        prompt_ids=batch.prompt_ids[p_src],
        prompt_offsets=p_off,
        response_ids=batch.response_ids[r_src],
        response_offsets=r_off,
        response_logprobs=batch.response_logprobs[r_src],
        group_index=new_group[resp_perm],
        finish_reason=batch.finish_reason[resp_perm],
    )
    return out, resp_perm


def select_responses(batch: RolloutBatch, keep: np.ndarray) -> RolloutBatch:
    """Keep the responses where `keep` ([N] bool) is true; prompts left with no
    response are dropped and group_index renumbered. One vectorized pass."""
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != (batch.num_responses,):
        raise ValueError(f"keep: expected shape ({batch.num_responses},), got {keep.shape}")
    lengths = batch.response_lengths
    tok_keep = np.repeat(keep, lengths)
    used = np.zeros(batch.num_prompts, dtype=bool)
    used[batch.group_index[keep]] = True
    remap = np.cumsum(used, dtype=np.int64) - 1
    p_len = batch.prompt_lengths
    return RolloutBatch(
        prompt_ids=batch.prompt_ids[np.repeat(used, p_len)],
        prompt_offsets=offsets_from_lengths(p_len[used]),
        response_ids=batch.response_ids[tok_keep],
        response_offsets=offsets_from_lengths(lengths[keep]),
        response_logprobs=batch.response_logprobs[tok_keep],
        group_index=remap[batch.group_index[keep]],
        finish_reason=batch.finish_reason[keep],
    )


def keep_nonzero_variance(batch: RolloutBatch, rewards: np.ndarray) -> np.ndarray:
    """[N] bool mask of responses whose group has reward variance."""
    zv = zero_variance_groups(rewards, batch.group_index, batch.num_prompts)
    return ~zv[batch.group_index]


# -- TrainPack transforms (the trainer plans first: split.build_split_pack) ---


def gather_seqs(pack: TrainPack, seq_order: np.ndarray) -> TrainPack:
    """A new pack holding pack's sequences in `seq_order` (one gather per field)."""
    cu = pack.cu_seqlens.numpy().astype(np.int64)
    new_len = pack.seq_lengths[seq_order]
    new_cu = offsets_from_lengths(new_len)
    idx = torch.from_numpy(runs_index(cu[:-1][seq_order], new_len, int(new_cu[-1])))
    fields = {f: getattr(pack, f)[idx] for f in PACKED_TOKEN_FIELDS if f != "seq_index"}
    order_t = torch.from_numpy(seq_order)
    return TrainPack(
        **fields,
        seq_index=torch.from_numpy(np.repeat(np.arange(seq_order.size, dtype=np.int32), new_len)),
        cu_seqlens=torch.from_numpy(new_cu.astype(np.int32)),
        seq_weights=pack.seq_weights[order_t],
        sample_index=pack.sample_index[order_t],
    )


def loss_tokens_per_seq(pack: TrainPack) -> np.ndarray:
    """[S] int64 loss tokens per sequence (= response length)."""
    if pack.num_seqs == 0:
        return np.zeros(0, dtype=np.int64)
    cu = pack.cu_seqlens.numpy().astype(np.int64)
    csum = np.concatenate([[0], np.cumsum(pack.loss_mask.numpy(), dtype=np.int64)])
    return csum[cu[1:]] - csum[cu[:-1]]


def split_pack(pack: TrainPack, world_size: int, max_tokens: int, *, num_minibatches: int = 1,
               loss_agg: LossAgg = "token-mean", norm_len: int | None = None) -> SplitPack:
    """Reorder an existing pack into per-rank, token-budgeted micro-batches
    (see `plan_split`): what build_split_pack builds directly."""
    plan = plan_split(pack.seq_lengths, world_size, max_tokens, num_minibatches=num_minibatches)
    weights = aggregation_weights(loss_tokens_per_seq(pack)[plan.seq_order], plan, loss_agg, norm_len)
    return SplitPack(gather_seqs(pack, plan.seq_order).with_seq_weights(torch.from_numpy(weights)), plan)


def rank_debug(be, actions: dict[int, str] | str, seconds: float = 0.0) -> None:
    """Run a test action ('sleep', 'raise', 'barrier', 'noop': rank_test_hooks.cmd_debug)
    on every rank of a TorchBackend, or {rank: action} (others: 'noop')."""
    stream = be.open_stream("debug")
    for r in range(be.world_size):
        action = actions if isinstance(actions, str) else actions.get(r, "noop")
        stream.send(r, "debug", action=action, seconds=seconds)
    stream.gather(be.config.command_timeout_s)


def list_segments(pid: int | None = None) -> list[str]:
    """Names of live areno backend segments (of one controller pid, or all)."""
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def loaded_lora_ids(engine) -> set[int]:
    """The adapter ids a vLLM engine holds now (its list_loras)."""
    return set(engine.adapters.llm.llm_engine.list_loras())


def refused(args: list[str], capsys) -> str:
    """`areno train ARGS` in-process -> its one error line; asserts exit 2, exactly
    one "areno: error:" line on stderr and no traceback."""
    from areno.cli import main

    rc = main(["train", *args])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2, out.err
    assert len(lines) == 1 and lines[0].startswith("areno: error:"), out.err
    assert "Traceback" not in out.err + out.out
    return lines[0]


class InProcessEngines:
    """A rollout engine of this process as the loop's EngineView: colocated, so
    its rounds run when collected (background False) and it has no processes
    to die. Everything else (generate, generate_stream, a stand-in's calls) is
    the engine's own."""

    background = False
    dead = None

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
