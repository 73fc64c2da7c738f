"""What a multi-turn trajectory a Ctrl-C halted keeps beside its tokens
(--partial-rollouts: the engines end every request at their next decode step,
fleet/inflight_loads.py's halt), so that a resumed run continues it where it
stopped (envs/resume.py): how it stopped, its turns, its environment's state.
It rides in its round's RewardResult.payloads ([N], None where not halted)
into the checkpoint of the rounds in flight (scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from areno.envs.plugin import EnvState

MID_TURN = 1   # halted while sampling a turn: the turn continues on resume
NEXT_TURN = 2  # halted before its next turn (its environment had answered): that turn starts on resume


@dataclass(frozen=True)
class Halted:
    """One halted trajectory: kind (MID_TURN or NEXT_TURN), its turns so far (a
    cut turn counted), the tokens its cut turn has (0 for NEXT_TURN), and its
    environment's state after the last step it answered."""

    kind: int
    turns: int
    turn_tokens: int
    state: EnvState
