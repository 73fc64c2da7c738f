"""An engine process's multi-turn rounds (EngineWorker.cmd_episodes): what goes
back (`episode_part`, one message per part of groups), the seed share of a
round's generate calls (`SeedShare`), and, under --partial-rollouts, the rounds
queued behind the running one joining it while its trajectories wait on their
environments (`run_episode_rounds`, the multi-turn tail fill).

The rounds-in-one-loop rule (envs/rounds.py): the next queued `episodes`
command joins when no trajectory of the running rounds is ready for a turn,
i.e. when the engine would otherwise idle on environments. What holds, as for
single-turn tail fill (fleet/tail_fill.py): a joining round's own weights are
loaded first when newer (InflightLoads.adopt), so no token of it samples
weights older than its admission's; each round streams its own parts (a part
of a round whose older rounds have not replied is tagged `ahead` j, so the
controller routes it: procs/replies.Peers.route) and gets its own reply, in
command order, with `tail_filled` counting the trajectories it started inside
another round's loop. An agent's round (--agent-path) runs alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from areno.rollout.engine import engine_sampling


def episode_part(done: Any, engine: int) -> dict:
    """An EnvRollout (or AgentRollout) of engine process `engine` -> the part message
    of cmd_episodes: its groups' positions (a streamed part's, else all), its
    arrays inline (whole buffers), its prompts (an agent's conversation chose
    them), turn_cut and the tokens' versions, the rewards and counts, the env/* (and
    agent/*) metrics, the trajectories' turns, and the books of those a halt
    ended (envs/halted.py)."""
    b, sc = done.batch, done.scored
    pos = getattr(done, "positions", None)
    return dict(positions=np.arange(b.num_prompts, dtype=np.int64) if pos is None else pos, engine=engine,
                lengths=np.diff(b.response_offsets),
                finish=b.finish_reason, start=0, ids=b.response_ids, logprobs=b.response_logprobs,
                mask=b.response_mask, prompt_ids=b.prompt_ids, prompt_offsets=b.prompt_offsets,
                turn_cut=b.turn_cut, rewards=sc.rewards, valid=sc.valid, counts=sc.counts,
                messages=sc.messages, env=done.metrics(), turns=done.turns,
                **({} if b.token_version is None else {"versions": b.token_version}),
                **({} if sc.payloads is None else {"halted": sc.payloads}))


class SeedShare:
    """An engine whose generate calls sample as engine g of E does under the
    controller's split (rollout.engine.engine_sampling)."""

    def __init__(self, engine: Any, g: int, num: int) -> None:
        self.engine, self.g, self.num = engine, g, num
        self.max_model_len = engine.max_model_len

    def generate_stream(self, ids, offsets, n, sampling, min_groups: int = 1):
        return self.engine.generate_stream(ids, offsets, n, engine_sampling(sampling, self.g, self.num),
                                           min_groups=min_groups)


def joinable(cmd: str, kwargs: dict, spec: Any) -> bool:
    """Whether a queued command may join the running rounds: a partial multi-turn
    round (a version given) of the same spec, not an agent's, with prompts."""
    return (cmd == "episodes" and kwargs.get("version") is not None and kwargs["spec"] == spec
            and not spec.agent and kwargs["offsets"].size > 1)


@dataclass
class _Round:
    reply: dict
    t0: float
    version: int | None  # admitted with (--cut-at-deadline: InflightLoads.due)
    tokens: int | None = None  # set when it ended


def run_episode_rounds(worker: Any, first: dict, reply: dict) -> dict:
    """Round `first` (cmd_episodes' arguments: ids, offsets, n, sampling, spec,
    states, share; its weights loaded, `reply` holding its loads and idle_s) and
    the queued rounds that join it; every reply but the last sent in order
    (worker.reply) -> the last one's. An environment's failure under `fail`
    ends every taken round with its reward_error."""
    from areno.envs.rounds import run_rounds
    from areno.rewards.plugin import RewardError

    spec = first["spec"]
    rounds = [_Round(reply | {"tail_filled": 0}, time.perf_counter(), first["version"])]
    replied = 0

    def driver(kw: dict, k: int) -> Any:
        def emit(part: Any) -> None:
            meta = episode_part(part, worker.index)
            if k > replied:
                meta["ahead"] = k - replied  # its older rounds' replies are still owed
            worker.emit(meta)
        return worker._episodes.driver(SeedShare(worker.engine, *kw["share"]), spec, kw["ids"], kw["offsets"],
                                       kw["states"], kw["n"], kw["sampling"], emit)

    def admit() -> Any:
        taken = worker.inbox.pop_if(lambda cmd, kw: joinable(cmd, kw, spec))
        if taken is None:
            return None
        kw = taken[1]
        worker.inflight.adopt(kw.get("region"), kw["version"])
        rounds.append(_Round({"idle_s": 0.0, "tail_filled": len(kw["states"])}, time.perf_counter(), kw["version"]))
        return driver(kw, len(rounds) - 1)

    def done(k: int, out: Any) -> None:
        nonlocal replied
        rounds[k].tokens = int(out.batch.response_ids.size)
        while replied < len(rounds) - 1 and rounds[replied].tokens is not None:
            worker.reply(_close(rounds[replied], worker.inflight.figures()))
            replied += 1

    try:
        worker.engine.cut_samples += run_rounds(driver(first, 0), admit, done, worker.inflight.halting,
                                                lambda k: worker.inflight.due(rounds[k].version))
    except RewardError as e:
        for r in rounds[replied:-1]:
            worker.reply(r.reply | {"reward_error": str(e), "tokens": 0})
        return rounds[-1].reply | worker.inflight.finish() | {"reward_error": str(e), "tokens": 0}
    finally:
        worker._idle_since = time.monotonic()
    return _close(rounds[-1], worker.inflight.finish())


def _close(r: _Round, figures: dict) -> dict:
    """Round r ended -> its reply (its tokens, its time, the loads counted)."""
    return r.reply | figures | {"tokens": r.tokens, "generate_s": time.perf_counter() - r.t0}
