"""The options of asynchronous rollouts (--off-policy-steps, --rollout-world-size)
and the rules between them and the loss: the defaults that K >= 1 turns on and
the combinations it refuses. The objective itself is losses.py's (decoupled
PPO); the loop that overlaps rollouts with training is scheduler.py's.

No torch here: config.py (read before anything heavy) calls it.
"""

from __future__ import annotations

from typing import Any

from areno.errors import UserError

# Default --tis-cap under --off-policy-steps >= 1: Yao et al.'s truncated IS uses
# C = 2 and so does verl's token-level TIS threshold; AReaL's 5 is a mask (a token
# over it is dropped), which must be looser than a truncation that keeps the token.
# With a few versions of staleness nearly every weight is near 1, and 2 bounds
# the rest: no token counts more than twice what it would on-policy.
OFF_POLICY_TIS_CAP = 2.0

def weight_slots(k: int) -> int:
    """Weight regions split placement rotates over at --off-policy-steps k: version
    v goes into slot v % slots and must outlive the K rounds queued before the one
    that loads it (scheduler.py); at K = 0 two, so a publish never overwrites the
    region an engine may still be reading."""
    return max(2, k + 1)


def _at_least_one(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value >= 1


def partial_default(m: Any, k: Any) -> bool:
    """--partial-rollouts where no flag or --config set it: on under split placement
    (--rollout-world-size m >= 1) at --off-policy-steps k >= 1, where weights can
    change while a rollout runs; off otherwise (check_partial's limits)."""
    return _at_least_one(m) and _at_least_one(k)


def partial_on(cfg: Any) -> bool:
    """Whether a TrainConfig's run takes partial rollouts: its --partial-rollouts,
    or partial_default where unset (None: a TrainConfig built without from_sources)."""
    given = getattr(cfg, "partial_rollouts", False)
    return partial_default(cfg.rollout_world_size, cfg.off_policy_steps) if given is None else bool(given)


def off_policy_defaults(values: dict[str, Any]) -> list[str]:
    """--off-policy-steps K >= 1 turns on --recompute-logprobs and --tis-cap, and
    under split placement --partial-rollouts (the values config.yaml records),
    where neither a flag nor --config set them; the flags it set, for the line
    that says so (turned_on_line). recompute_logprobs: false in --config (the
    switch has no --no- form) is refused by check_off_policy()."""
    if not _at_least_one(values.get("off_policy_steps")):
        return []  # off, or a bad value TrainConfig.validate() names
    turned_on = []
    if values.get("recompute_logprobs") is None:
        values["recompute_logprobs"] = True
        turned_on.append("--recompute-logprobs")
    if values.get("tis_cap") is None:
        values["tis_cap"] = OFF_POLICY_TIS_CAP
        turned_on.append(f"--tis-cap {OFF_POLICY_TIS_CAP:g}")
    if values.get("partial_rollouts") is None and partial_default(values.get("rollout_world_size"),
                                                                  values.get("off_policy_steps")):
        values["partial_rollouts"] = True
        turned_on.append("--partial-rollouts")
    return turned_on


def turned_on_line(k: int, turned_on: list[str]) -> str:
    """The line that says what --off-policy-steps k turned on, and why."""
    loss = [f for f in turned_on if f != "--partial-rollouts"]
    why = []
    if loss:
        why.append(" and ".join(loss) + " (decoupled PPO: the trainer's log-probs are the proximal "
                   "policy, capped importance weights correct for the stale sampler)")
    if "--partial-rollouts" in turned_on:
        why.append("--partial-rollouts (engines take new weights mid-generation and a step trains "
                   "the groups that finish first; --whole-rounds: each rollout on one version, a "
                   "resume bit-exact)")
    return f"areno: --off-policy-steps {k} turns on " + " and ".join(why)


def check_off_policy(cfg: Any) -> None:
    """--off-policy-steps and --rollout-world-size of a TrainConfig against the
    options they need: UserError (one line) for the first that is missing."""
    k, m, tp = cfg.off_policy_steps, cfg.rollout_world_size, cfg.tensor_parallel_size
    if getattr(cfg, "cut_at_deadline", False) and not partial_on(cfg):
        raise UserError("--cut-at-deadline needs --partial-rollouts (on with --rollout-world-size and "
                        "--off-policy-steps >= 1): a sample is cut where its engine takes the trainer's "
                        "new weights, between two decode steps, and only partial rollouts' engines do")
    if getattr(cfg, "cut_at_deadline", False) and getattr(cfg, "agent_path", None) is not None:
        raise UserError("--cut-at-deadline with --agent-path: an agent's conversation lives in its own "
                        "program, which the engines cannot end at a deadline (they wait for it)")
    if m and tp > 1:
        raise UserError(f"--rollout-world-size {m} with --tensor-parallel-size {tp}: an engine "
                        "process holds one device, and vLLM's tensor-parallel workers need a device each "
                        "(colocated engines, without --rollout-world-size, take --tensor-parallel-size)")
    if not k:
        if getattr(cfg, "partial_rollouts", False):  # given: None (unset) is partial_default's
            check_partial(m, k)
        return
    flag = f"--off-policy-steps {k}"  # any K >= 1: K rollouts queue on the engines (scheduler.py)
    if not m:
        raise UserError(f"{flag} needs --rollout-world-size >= 1: colocated engines share the "
                        "training GPUs and sleep while the ranks train, so rollouts cannot "
                        "overlap with training; give the engines processes of their own")
    if not cfg.recompute_logprobs:
        raise UserError(f"{flag} needs --recompute-logprobs (the trainer's log-probs are "
                        "decoupled PPO's proximal policy); drop recompute_logprobs: false "
                        "from --config")
    if cfg.tis_cap is None:
        raise UserError(f"{flag} needs --tis-cap (the importance weight of a stale sample)")


def check_partial(m: int, k: int) -> None:
    """--partial-rollouts needs weights that change while a rollout runs: engine
    processes (split placement) and K >= 1 (a version published during a round)."""
    if not m:
        raise UserError("--partial-rollouts needs --rollout-world-size >= 1: colocated engines sleep "
                        "while the ranks train, so no new weights can arrive while they generate")
    if not k:
        raise UserError("--partial-rollouts needs --off-policy-steps >= 1: at 0 each rollout is "
                        "collected before the ranks train, so no version is published while one generates")
