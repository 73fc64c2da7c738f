"""The LoRA options (--lora-rank, --lora-alpha, --lora-dropout,
--lora-target-modules, --save-merged): their learning-rate default and the
rules between them. The target names are checked against the model at start-up
(backend.lora.lora_plan), where the model is known."""

from __future__ import annotations

import json
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
    check_lora_tp(cfg.tensor_parallel_size)
    targets = lora_targets(cfg.lora_target_modules)
    if not targets:
        raise UserError("--lora-target-modules: name at least one module (or all-linear)")
    if "all-linear" in targets and set(targets) - {"all-linear", "lm_head"}:
        raise UserError("--lora-target-modules: all-linear already names every decoder linear; "
                        "give it alone or with lm_head")
    if "lm_head" in targets and cfg.lora_dropout > 0:
        # the trainer multiplies by lm_head's merged weight (backend.lora.head_weight)
        raise UserError("--lora-dropout with lm_head in --lora-target-modules: lm_head's adapter "
                        "trains without dropout; drop one")


def check_lora_tp(tp: int) -> None:
    """LoRA with a tensor-parallel engine is refused: the adapter's sync check
    (rollout.lora's checksum) compares whole tensors, a TP shard holds slices of
    some (column-parallel B, row-parallel A) and copies of others, and a summed
    checksum could only be tested on a multi-process vLLM TP group, which the CPU
    build does not run here; the probe alone cannot tell a small adapter from
    the base model (issue 26)."""
    if tp > 1:
        raise UserError(f"LoRA with --tensor-parallel-size {tp}: the adapter sync is checked on "
                        "whole tensors only; use --tensor-parallel-size 1 (or full fine-tuning)")


# adapter_config.json (peft's LoraConfig): the fields areno serves as peft computes them
HONOURED = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")
# Fields that do not change a loaded adapter's forward: bookkeeping, and the
# initialisations the saved A and B replace (those that also rewrite the base
# weights, pissa / olora / corda / loftq / lora_ga, or add a variant, mica, are not).
IGNORED = ("task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
           "inference_mode", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config",
           "megatron_core", "init_lora_weights")
INIT_A_B_ONLY = (True, False, "gaussian", "eva", "orthogonal")  # init_lora_weights that touch A, B only


def _peft_defaults() -> dict[str, Any]:
    import dataclasses

    from peft import LoraConfig

    out = {}
    for f in dataclasses.fields(LoraConfig):
        out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


def adapter_settings(saved: dict, where: str) -> dict[str, Any]:
    """A saved adapter's adapter_config.json -> {rank, alpha, dropout, targets,
    use_rslora} (LoraSpec's fields). Every other field must be one that does not
    change the forward (IGNORED) or hold peft's default; else a UserError naming
    the first such field: areno would train and serve it as plain LoRA, and its
    outputs would not be the adapter's (issue 26)."""
    defaults = _peft_defaults()
    for key, value in saved.items():
        if key in HONOURED or (key in IGNORED and key != "init_lora_weights"):
            continue
        if key == "init_lora_weights":
            if any(value is v or value == v and not isinstance(v, bool) for v in INIT_A_B_ONLY):
                continue
        elif key in defaults and (value == defaults[key] or (not value and not defaults[key])):
            continue
        elif key not in defaults and not value:  # a field of another peft version, unset
            continue
        raise UserError(f"{where}: adapter_config.json sets {key}={json.dumps(value, default=str)}, which "
                        f"areno does not serve (it takes r, lora_alpha, lora_dropout, target_modules, "
                        f"use_rslora); convert the adapter to plain LoRA or drop {key}")
    r, targets = saved.get("r"), saved.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise UserError(f"{where}: adapter_config.json's target_modules is the pattern {targets!r}; "
                        "areno takes a list of module names (or all-linear)")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserError(f"{where}: adapter_config.json's r must be an int >= 1, got {r!r}")
    alpha, dropout = saved.get("lora_alpha", defaults["lora_alpha"]), saved.get("lora_dropout") or 0.0
    if not isinstance(alpha, (int, float)) or not alpha > 0 or not 0 <= float(dropout) < 1:
        raise UserError(f"{where}: adapter_config.json's lora_alpha must be > 0 and lora_dropout in [0, 1), "
                        f"got {alpha!r}, {dropout!r}")
    # peft matches a target as a module name's suffix; a full path (peft writes them for
    # all-linear) names its leaf, and backend.lora.check_adapter_modules then makes sure
    # the saved tensors cover every module of that leaf name, no more, no fewer
    targets = [targets] if isinstance(targets, str) else sorted({t.rsplit(".", 1)[-1] for t in targets or ()})
    targets = targets or ["all-linear"]
    return {"rank": r, "alpha": float(alpha), "dropout": float(dropout), "target_modules": tuple(targets),
            "use_rslora": bool(saved.get("use_rslora", False))}
