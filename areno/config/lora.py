"""The LoRA options (--lora-rank, --lora-alpha, --lora-dropout,
--lora-target-modules, --save-merged): their learning-rate default and the
rules between them. The target names are checked against the model at start-up
(backend.lora.lora_plan), where the model is known."""

from __future__ import annotations

from typing import Any

from areno.errors import UserError

FULL_FT_LR = 1e-6  # --lr unset
LORA_LR_FACTOR = 10.0  # --lr unset with --lora-rank > 0: FULL_FT_LR x this ("LoRA without regret")


def lora_targets(value: str) -> tuple[str, ...]:
    """--lora-target-modules -> module leaf names (("all-linear",) for all of them)."""
    return tuple(t.strip() for t in value.split(",") if t.strip())


def check_lora_options(cfg: Any) -> None:
    """The LoRA options against each other (the target names against the model: at start-up)."""
    if cfg.lora_rank == 0:
        given = [flag for flag, on in (("--lora-alpha", cfg.lora_alpha is not None),
                                       ("--lora-dropout", cfg.lora_dropout != 0.0),
                                       ("--lora-target-modules", cfg.lora_target_modules != "all-linear"),
                                       ("--save-merged", cfg.save_merged)) if on]
        if given:
            raise UserError(f"{given[0]} needs --lora-rank > 0 (0 is full fine-tuning)")
        return
    if cfg.rollout_world_size:
        raise UserError("--lora-rank with --rollout-world-size: engine processes take full weights "
                        "only so far, not adapters; drop one (colocated engines serve adapters)")
    targets = lora_targets(cfg.lora_target_modules)
    if not targets:
        raise UserError("--lora-target-modules: name at least one module (or all-linear)")
    if "all-linear" in targets and len(targets) > 1:
        raise UserError("--lora-target-modules: all-linear already names every linear; give it alone")
