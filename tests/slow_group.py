"""A controllable slow group for --partial-rollouts runs in the test's own process
(tests/test_partial_rollouts.py, inprocess.run_here): the controller's reading
of the engines' parts is wrapped so that the first rollout's group at position
0 arrives only after the `hold`-th later rollout delivered a part, as if its
last sample ran that long (the transformers engine generates a round in one
call, so no real group of round 1 can finish after round 2's). Nothing in the
engine processes changes. `Steps` records what each step trained
(first_finished.next_groups, spied)."""

from __future__ import annotations

from typing import Any

import numpy as np


class HeldSink:
    """A rollout's sink, its group at position 0 held back when `held` is set."""

    def __init__(self, inner: Any, slow: "SlowGroup", first: bool) -> None:
        self.inner, self.slow, self.first = inner, slow, first
        self.delivered = False
        self.last: tuple[np.ndarray, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def keep(self, pos: np.ndarray, part: Any, meta: dict | None = None) -> None:
        if self.first and (pos == 0).any():
            rest = np.flatnonzero(pos != 0)
            self.slow.held = (pos[pos == 0], part.take_groups(np.flatnonzero(pos == 0))[0], meta)
            pos, part = pos[rest], part.take_groups(rest)[0]
        self.last = (pos, part)
        if pos.size:
            self.inner.keep(pos, part, meta)
        if not self.first and not self.delivered:
            self.delivered = True
            self.slow.later_delivered(self)

    def score(self, pos: np.ndarray, part: Any) -> None:
        pos, part = self.last
        if pos.size:
            self.inner.score(pos, part)


class SlowGroup:
    """Installs the hold (monkeypatch: PendingRollout's sink wrapped)."""

    def __init__(self, monkeypatch: Any, hold: int) -> None:
        from areno.fleet.rollouts import PendingRollout

        self.hold, self.rollouts, self.later = hold, 0, 0
        self.held: tuple | None = None
        self.first_sink: HeldSink | None = None
        init = PendingRollout.__init__

        def wrapped(pr: Any, engines: Any, stream: Any, plan: Any, sink: Any) -> None:
            self.rollouts += 1
            held = HeldSink(sink, self, first=self.rollouts == 1)
            self.first_sink = self.first_sink or held
            init(pr, engines, stream, plan, held)
        monkeypatch.setattr(PendingRollout, "__init__", wrapped)

    def later_delivered(self, sink: HeldSink) -> None:
        self.later += 1
        if self.later == self.hold and self.held is not None:
            pos, part, meta = self.held
            self.held = None
            self.first_sink.inner.keep(pos, part, meta)
            self.first_sink.inner.score(pos, part)


class Steps:
    """Per step: the prompts it trained and its response tokens; the prompts of
    each round started, in order (rounds[0][0]: the slow group's)."""

    def __init__(self, monkeypatch: Any) -> None:
        from areno import first_finished
        from areno.scheduler import Rollouts

        self.prompts: dict[int, list[int]] = {}
        self.tokens: dict[int, int] = {}
        self.rounds: list[list[int]] = []
        take, start = first_finished.next_groups, Rollouts.start

        def spied(sched: Any, step: int, timer: Any, informative: Any = None) -> Any:
            out = take(sched, step, timer, informative)
            self.prompts[step] = sorted(out[0].round.prompt_idx.tolist())
            self.tokens[step] = out[0].round.batch.num_response_tokens
            return out

        def started(sched: Any, step: int) -> Any:
            cur = start(sched, step)
            self.rounds.append(cur.prompt_idx.tolist())
            return cur
        monkeypatch.setattr(first_finished, "next_groups", spied)
        monkeypatch.setattr(Rollouts, "start", started)
