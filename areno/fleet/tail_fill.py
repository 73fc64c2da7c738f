"""Tail fill (issue 39): an engine process under --partial-rollouts starts the
rollout queued behind the one it runs inside the same generation loop, as the
running one's long tail drains, so the engine stays busy across round
boundaries.

The rule (`fill_now`): the next queued round joins once the sequences the engine
still holds are fewer than that round would add. Rounds are equal in size in a
run (--batch-size prompts x --n-samples, split over the engines), so this is
"as soon as the running round has finished a sample", and it keeps the batch
below two rounds' worth: the KV cache never holds more than two rounds need,
and the running round's tail shares decode steps with at most one round.

What holds, round by round:
  weights   before a queued round's requests join, its own region is loaded
            (InflightLoads.adopt: in flight, between decode steps) when newer
            than the weights held, so none of its tokens is sampled with weights
            older than the ones the scheduler admitted it with (the policy lag
            bound holds); the running round's later tokens carry the newer
            version (token_version): it only gets fresher.
  parts     each round writes its own OutRegion and streams its own parts; a
            part of a round whose older rounds have not replied yet is tagged
            "ahead" j (how many of them), so the controller's reader puts it in
            the right rollout's inbox (procs/replies.py, Peers.route).
  replies   each command still gets its own reply (tokens, idle_s, generate_s,
            the loads, tail_filled: its sequences started inside another
            round's loop), in command order, when its own samples are done.

Both engines have the loop (`generate_rounds`): vLLM adds requests between
`step()` calls (rollout/vllm_rounds.py); the transformers engine, whose
`generate` fixes its rows at its start, chains generates and carries the
running samples into the next one with the round that joins
(rollout/hf_rounds.py). Multi-turn `episodes` commands have their own
(fleet/episode_rounds.py: their turns come from the episode driver, not from
one generation loop).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areno.fleet.engine_host import OutRegion, PartWriter


def fill_now(running: int, next_sequences: int) -> bool:
    """The rule: a queued round of `next_sequences` sequences joins the generation
    when the engine holds fewer than that (`running`, its waiting ones included)."""
    return running < next_sequences


def fillable(cmd: str, kwargs: dict) -> bool:
    """Whether a queued command may join a running generation: a partial rollout
    (a version given) with prompts and its arrays here (no payload to read)."""
    return (cmd == "rollout" and kwargs.get("version") is not None and not kwargs.get("payload")
            and kwargs["offsets"].size > 1)


@dataclass
class _Round:
    """One round of the loop: where it writes, what it still owes, its reply so far."""

    writer: PartWriter
    groups_left: int
    reply: dict
    t0: float = field(default_factory=time.perf_counter)


def run_rounds(worker: Any, first: Any, out: OutRegion, reply: dict) -> dict:
    """Generate `first` (a RoundRequest; its weights loaded, `reply` holding its
    loads and idle_s) and the rounds that join it; send every round's reply but
    the last (worker.reply), in order -> the last one's (serve_worker sends it)."""
    from areno.rollout.engine import RoundRequest

    rounds = [_Round(PartWriter(out), first.offsets.size - 1, reply | {"tail_filled": 0})]
    replied = 0

    def admit(running: int) -> RoundRequest | None:
        taken = worker.inbox.pop_if(lambda cmd, kw: fillable(cmd, kw) and fill_now(
            running, (kw["offsets"].size - 1) * kw["n"]))
        if taken is None:
            return None
        kw = taken[1]
        worker.inflight.adopt(kw.get("region"), kw["version"])
        worker.hooks.rollout_begin(worker.index)
        sequences = (kw["offsets"].size - 1) * kw["n"]
        rounds.append(_Round(PartWriter(kw["out"]), kw["offsets"].size - 1,
                             {"idle_s": 0.0, "tail_filled": sequences}))
        return RoundRequest(kw["ids"], kw["offsets"], kw["n"], kw["sampling"], kw["version"])

    try:
        for k, pos, part in worker.engine.generate_rounds(first, admit):
            meta = rounds[k].writer.write(pos, part)
            if k > replied:
                meta["ahead"] = k - replied  # its older rounds' replies are still owed
            worker.emit(meta)
            rounds[k].groups_left -= int(np.asarray(pos).size)
            while replied < len(rounds) - 1 and rounds[replied].groups_left == 0:
                worker.reply(_close(worker, rounds[replied], worker.inflight.figures()))
                replied += 1
        while replied < len(rounds) - 1:  # every round is done: the loop ended
            worker.reply(_close(worker, rounds[replied], worker.inflight.figures()))
            replied += 1
        last, figures = rounds[-1], worker.inflight.finish()
    finally:
        worker.engine.step_hook = None
        for r in rounds:
            r.writer.close()
    return _close(worker, last, figures)


def _close(worker: Any, r: _Round, figures: dict) -> dict:
    """Round r is done -> its reply (its writer's tokens, its time, the loads counted)."""
    tokens = r.writer.cursor
    worker.hooks.rollout_end(worker.index, tokens)
    return r.reply | figures | {"tokens": tokens, "generate_s": time.perf_counter() - r.t0}
