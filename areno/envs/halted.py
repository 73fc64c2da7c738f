"""What a multi-turn trajectory a Ctrl-C halted keeps beside its tokens
(--partial-rollouts: the engines end every request at their next decode step,
fleet/inflight_loads.py's halt), so that a resumed run continues it where it
stopped (envs/resume.py): how it stopped, its turns, its environment's state.
It rides in its round's RewardResult.payloads ([N], None where not halted)
into the checkpoint of the rounds in flight (scheduler.py).

A trajectory whose environment call is out when the halt comes is not waited
for (`halt_waiting`): a slow or heavy-tailed environment would hold the save.
Its call is asked again on resume, from the state it was asked with: an
environment's state changes only with an answer (envs/driver.py's settle), so
the step repeats as it would have run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areno.envs.plugin import EnvState
from areno.rollout.batch import FINISH_ABORT

MID_TURN = 1   # halted while sampling a turn: the turn continues on resume
NEXT_TURN = 2  # halted before its next turn (its environment had answered): that turn starts on resume
STEP_DUE = 3   # halted while its environment stepped on its last turn: the step is asked again on resume
RESET_DUE = 4  # halted while its environment reset: the reset is asked again on resume


@dataclass(frozen=True)
class Halted:
    """One halted trajectory: kind (above), its turns so far (a cut turn
    counted), the tokens its cut turn has (MID_TURN; else 0), its environment's
    state after the last step it answered, and the text of the turn whose
    step is due (STEP_DUE; else None)."""

    kind: int
    turns: int
    turn_tokens: int
    state: EnvState
    completion: str | None = None


def halt_waiting(d: Any) -> None:
    """The run is saving: every trajectory of driver `d` (envs/driver.py's _Driver)
    that waits on its environment ends now, finish "abort", with its books; its
    calls out are left to the workers (their answers are never read). The
    rounds' loop calls it when no trajectory is ready for a turn."""
    for i, is_step in d.pending.values():
        d.halted[i] = STEP_DUE if is_step else RESET_DUE
        d.end(i, FINISH_ABORT)
    d.pending = {}
