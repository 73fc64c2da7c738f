"""Tail fill for the vLLM engine: several rounds in one generation loop.

A round is one rollout command's prompts (fleet/tail_fill.py decides when a
queued one joins). `stream_rounds` runs the first round as
VLLMEngine.generate_stream does, and at every step boundary, after the step
hook (in-flight loads: rollout/vllm_inflight.py), asks `admit` for another:
its requests are added to the running LLMEngine between two `step()` calls, so
vLLM batches them with the tail of the rounds before. Each round keeps its own
SwapLog (its tokens' versions start at the weights held when it joined) and
its own positions; parts come out tagged with their round.

Only under --partial-rollouts: a round that joins mid-loop shares decode steps
with another, which changes nothing of what it samples in expectation but is
not the bit-exact schedule of the default mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areno.rollout.batch import RolloutBatch, offsets_from_lengths
from areno.rollout.engine import RoundRequest, due
from areno.rollout.vllm_inflight import SwapLog, cut_requests, halt_requests
from areno.rollout.vllm_outputs import batch_from_request_outputs


@dataclass
class _Round:
    """A round in the loop: its prompts' views, vLLM's request ids, its SwapLog."""

    offsets: np.ndarray
    pieces: list[np.ndarray]
    req_ids: list[str]
    n: int
    swaps: SwapLog
    version: int | None = None  # admitted with (rollout.engine.due)
    cut: bool = False  # its samples still running were cut at its deadline
    done: list[Any] = field(default_factory=list)  # finished outputs not yet yielded


class _AllSwaps:
    """Stands for VLLMEngine._swaps: an in-flight swap is recorded in every live round's log."""

    def __init__(self) -> None:
        self.logs: list[SwapLog] = []

    def record(self, engine_core: Any, version: int) -> None:
        for log in self.logs:
            log.record(engine_core, version)


def running_sequences(engine: Any) -> int:
    """Sequences the in-process vLLM scheduler holds (running or waiting): each
    of a request's n samples counts."""
    return int(engine.llm.llm_engine.engine_core.engine_core.scheduler.get_num_unfinished_requests())


def stream_rounds(engine: Any, first: RoundRequest, admit: Callable[[int], RoundRequest | None],
                  ) -> Iterator[tuple[int, np.ndarray, RolloutBatch]]:
    """Yield (round k, prompt positions [p] of round k, RolloutBatch of those p
    groups) as groups finish; round 0 is `first`, round k + 1 the k + 1-th
    request admit(sequences running) returned (None: none now). engine: a
    VLLMEngine (in-process). Ends when every admitted round is done."""
    llm_engine = engine.llm.llm_engine
    rounds: list[_Round] = []
    where: dict[str, tuple[int, int]] = {}  # vLLM's output id -> (round, position)
    swaps = _AllSwaps()

    def enqueue(req: RoundRequest) -> None:
        _, offsets, pieces, prompts, params = engine._requests(req.ids, req.offsets, req.n, req.sampling)
        req_ids = engine.llm.enqueue(prompts, params, use_tqdm=False, lora_request=engine._lora())
        # enqueue returns "<counter>-<suffix>"; finished outputs carry "<counter>".
        where.update({rid.split("-", 1)[0]: (len(rounds), i) for i, rid in enumerate(req_ids)})
        rounds.append(_Round(offsets, pieces, req_ids, req.n, SwapLog(engine.weight_version), req.version))
        swaps.logs.append(rounds[-1].swaps)

    enqueue(first)

    def finished() -> Iterator[tuple[int, np.ndarray, RolloutBatch]]:
        for k, r in enumerate(rounds):
            if r.done:
                yield k, *_part(r, [where[o.request_id][1] for o in r.done])
                r.done = []
    engine._swaps, steps = swaps, 0
    try:
        while llm_engine.has_unfinished_requests():
            for o in llm_engine.step():
                if o.finished:
                    rounds[where[o.request_id][0]].done.append(o)
            steps += 1
            yield from finished()
            if not llm_engine.has_unfinished_requests():
                break
            if engine.step_hook is not None:
                engine.step_hook(steps)
                if engine.halt:  # the run is saving: every request ends now with its tokens
                    for o in halt_requests(llm_engine):
                        rounds[where[o.request_id][0]].done.append(o)
                    yield from finished()
                    return
                _cut_due(engine, rounds)
                yield from finished()
            if (req := admit(running_sequences(engine))) is not None:
                enqueue(req)
    finally:
        engine._swaps = None


def _cut_due(engine: Any, rounds: list[_Round]) -> None:
    """--cut-at-deadline: the samples still running of every round now due end
    with the tokens they have (finish "length"; their outputs join round.done)."""
    for r in rounds:
        if not r.cut and due(r.version, engine.cut_version):
            outs, cut = cut_requests(engine.llm.llm_engine, r.req_ids, r.n)
            r.done += outs
            r.cut, engine.cut_samples = True, engine.cut_samples + cut


def _part(r: _Round, positions: list[int]) -> tuple[np.ndarray, RolloutBatch]:
    """The finished outputs of round r (its positions) -> (positions, the stamped batch)."""
    pos = np.asarray(positions, dtype=np.int64)
    lengths = np.diff(r.offsets)[pos]
    sub_ids = np.concatenate([r.pieces[i] for i in pos.tolist()])
    batch = batch_from_request_outputs(r.done, sub_ids, offsets_from_lengths(lengths), r.n)
    return pos, r.swaps.stamp(batch, [r.req_ids[p] for p in pos.tolist()], r.n)

