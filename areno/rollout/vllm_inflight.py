"""In-flight weight updates for the vLLM engine: new weights between two
`llm_engine.step()` calls, the requests it holds kept.

The weights are reloaded in place (the worker's `reload_weights`, as a full
load does); then every running request is preempted with its KV cache dropped
(`reset_prefix_cache(reset_running_requests=True)`): vLLM puts it back in the
waiting queue with its output tokens, and the next step prefills prompt and
output again under the new weights before it samples on. That is the
recompute policy (rollout/hf_inflight.py says why it is chosen over keeping the
old version's KV, as vLLM's keep-mode pause would); vLLM's own preemption does
the recompute, so no request is finished or dropped.

`SwapLog` records, at each swap, how many tokens each request had sampled: a
request's tokens past that count carry the new version (token_version). Each
count is read from the in-process scheduler (the engine core runs in this
process: VLLMEngine.multiprocess is False), O(requests) per swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from areno.rollout.batch import RolloutBatch


@dataclass
class SwapLog:
    """The swaps of one generation: (tokens sampled by each request id, version)."""

    start: int | None
    swaps: list[tuple[dict[str, int], int]] = field(default_factory=list)

    def record(self, engine_core: Any, version: int) -> None:
        """Before the preemption: every request's count of sampled tokens."""
        reqs = engine_core.scheduler.requests
        self.swaps.append(({rid: int(r.num_output_tokens) for rid, r in reqs.items()}, int(version)))

    def stamp(self, batch: RolloutBatch, enqueued: list[str], n: int) -> RolloutBatch:
        """A part of n samples of each enqueued prompt (vLLM's ids, in the part's
        order) with each token's version; as is when the engine was told none."""
        if self.start is None and not self.swaps:
            return batch
        rids = [c for e in enqueued for c in child_ids(e, n)]
        return replace(batch, token_version=self.versions(rids, batch.response_lengths))

    def versions(self, req_ids: list[str], lengths: np.ndarray) -> np.ndarray:
        """[sum lengths] int32: each token's version, response i being the tokens
        of request req_ids[i] (a request absent from a swap's counts had finished
        before it: all its tokens are older)."""
        out = np.full(int(lengths.sum()), -1 if self.start is None else self.start, dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        for counts, version in self.swaps:
            for i, rid in enumerate(req_ids):
                done = counts.get(rid, int(lengths[i]))
                out[starts[i] + done:starts[i] + lengths[i]] = version
        return out


def child_ids(enqueued: str, n: int) -> list[str]:
    """The scheduler's ids of the n samples of one enqueued prompt (vLLM's
    parallel sampling names sample j "<j>_<id>"; n = 1 keeps the id)."""
    return [enqueued] if n == 1 else [f"{j}_{enqueued}" for j in range(n)]


def halt_requests(llm_engine: Any, held: list[str] | None = None, finish: str = "abort") -> list[Any]:
    """End the requests `held` (vLLM's ids; None: every one the engine holds) now,
    with the tokens they sampled -> their final RequestOutputs (a prompt's n
    samples in one, as a finished request's), finish "abort" (the run is saving:
    fleet/inflight_loads.py's halt) or "length" (a --cut-at-deadline cut).
    vLLM's sync engine makes no output for an aborted request, so each one's is
    made from its output state (tokens and log-probs so far) before the abort."""
    from vllm.v1.engine import FinishReason

    states = llm_engine.output_processor.request_states
    held = list(states) if held is None else held
    reason = FinishReason.ABORT if finish == "abort" else FinishReason.LENGTH
    outputs = [o for rid in held if (o := states[rid].make_request_output([], None, reason, None)) is not None]
    llm_engine.abort_request(held, internal=True)
    return outputs


def cut_requests(llm_engine: Any, req_ids: list[str], n: int) -> tuple[list[Any], int]:
    """--cut-at-deadline: a due round's samples still running (its enqueued ids,
    n samples each) end now -> (their final RequestOutputs, finish "length";
    how many samples were cut)."""
    states = llm_engine.output_processor.request_states
    held = [c for e in req_ids for c in child_ids(e, n) if c in states]
    return (halt_requests(llm_engine, held, "length") if held else []), len(held)
