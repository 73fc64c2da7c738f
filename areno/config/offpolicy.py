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


def off_policy_defaults(values: dict[str, Any]) -> list[str]:
    """--off-policy-steps K >= 1 turns on --recompute-logprobs and --tis-cap (the
    values config.yaml records), where neither a flag nor --config set them; the
    flags it set, for the line that says so. recompute_logprobs: false in --config
    (the switch has no --no- form) is refused by check_off_policy()."""
    k = values.get("off_policy_steps")
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 1:
        return []  # off, or a bad value TrainConfig.validate() names
    turned_on = []
    if values.get("recompute_logprobs") is None:
        values["recompute_logprobs"] = True
        turned_on.append("--recompute-logprobs")
    if values.get("tis_cap") is None:
        values["tis_cap"] = OFF_POLICY_TIS_CAP
        turned_on.append(f"--tis-cap {OFF_POLICY_TIS_CAP:g}")
    return turned_on


def check_off_policy(cfg: Any) -> None:
    """--off-policy-steps and --rollout-world-size of a TrainConfig against the
    options they need: UserError (one line) for the first that is missing."""
    k, m, tp = cfg.off_policy_steps, cfg.rollout_world_size, cfg.tensor_parallel_size
    if m and tp > 1:
        raise UserError(f"--rollout-world-size {m} with --tensor-parallel-size {tp}: an engine "
                        "process holds one device, and vLLM's tensor-parallel workers need a device each "
                        "(colocated engines, without --rollout-world-size, take --tensor-parallel-size)")
    if getattr(cfg, "partial_rollouts", False):
        check_partial(m, k)
    if not k:
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
