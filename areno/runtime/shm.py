"""The run's shared memory on this host, checked before any rank starts.

What lives in /dev/shm (each sized here as its owner sizes it):
- split placement's weight regions: max(2, K + 1) slots of the full weights in the
  engines' dtype (`publish_weights(slot=v % slots)`, config.offpolicy.weight_slots, made one per publish);
  under LoRA each slot holds the adapter alone (the engines keep the base);
- the engines' result segments: one per rollout in flight (K + 1 under split
  placement, 1 colocated), int32 ids + float32 log-probs for every sampled token;
- the pack the controller hands the ranks (`backend/handoff.py`): 25 bytes per
  packed token (7 per-token fields);
- LoRA adapter directories a vLLM engine writes (`rollout/vllm_lora.py`): one
  per engine on this host, two while a new version replaces the old.
Docker's default /dev/shm is 64 MiB; without this check a small one fails at
step 1 .. K + 1, at the first segment that does not fit.
"""

from __future__ import annotations

import os

from areno.config.env import trajectory_tokens
from areno.config.offpolicy import weight_slots
from areno.config.train import TrainConfig
from areno.errors import UserError

SHM_DIR = "/dev/shm"
HEADROOM = 1.25  # ShmSegment.ensure's: a segment is made 25% larger than asked
PACK_BYTES_PER_TOKEN = 25  # int32 ids, targets, positions, seq index; float32 old logp, advantage; bool mask
RESULT_BYTES_PER_TOKEN = 8  # int32 token id + float32 log-prob
MIB = 1 << 20


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, None where it cannot be read (no /dev/shm)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shm_footprint(cfg: TrainConfig, weight_bytes: int, lora_bytes: int, engines_here: int) -> dict[str, int]:
    """Bytes of shared memory the run needs on this host, by part.

    weight_bytes: the full weights in the engines' dtype; lora_bytes: one adapter
    in that dtype (0 without LoRA); engines_here: rollout engines on this host."""
    split = cfg.rollout_world_size > 0
    slots = weight_slots(cfg.off_policy_steps) if split else 0
    in_flight = cfg.off_policy_steps + 1 if split else 1
    samples = cfg.batch_size * cfg.n_samples
    response = trajectory_tokens(cfg)
    parts = {
        f"{slots} weight slot(s) (--off-policy-steps {cfg.off_policy_steps}: max(2, K + 1))":
            slots * (lora_bytes or weight_bytes),
        f"{in_flight} rollout result segment(s)": int(in_flight * samples * response * RESULT_BYTES_PER_TOKEN
                                                     * HEADROOM),
        "the pack": int(samples * (cfg.max_prompt_len + response) * PACK_BYTES_PER_TOKEN * HEADROOM),
    }
    if lora_bytes and cfg.rollout_engine != "hf":  # only vLLM reads adapters from a directory
        parts[f"{engines_here} engine(s)' LoRA adapter dirs"] = 2 * engines_here * lora_bytes
    return {k: v for k, v in parts.items() if v}


def check_shm_room(cfg: TrainConfig, weight_bytes: int, lora_bytes: int, engines_here: int) -> None:
    """UserError naming the sizes and the fix unless /dev/shm has room for the
    whole footprint (shm_footprint)."""
    free = shm_free_bytes()
    parts = shm_footprint(cfg, weight_bytes, lora_bytes, engines_here)
    need = sum(parts.values())
    if free is None or free >= need:
        return
    what = ", ".join(f"{name} {size / MIB:,.1f} MiB" for name, size in parts.items())
    smaller = "--off-policy-steps" if cfg.rollout_world_size and cfg.off_policy_steps else \
        "--batch-size, --n-samples or --max-new-tokens"
    raise UserError(f"{SHM_DIR} has {free / MIB:,.1f} MiB free, but this run needs about {need / MIB:,.1f} "
                    f"MiB of shared memory ({what}); enlarge it (docker run --shm-size="
                    f"{-(-need * 2 // (1 << 30))}g) or lower {smaller}")
