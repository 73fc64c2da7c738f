"""The rules between TrainConfig's options, run by TrainConfig.from_sources and
validate before any heavy import: what the demo fills in where nothing was given,
and the combinations refused (each a UserError, one line naming the flags). One
option's own type and bounds are fieldcheck.py's; the LoRA and off-policy rules
live in lora.py and offpolicy.py, called from here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areno.config.fieldcheck import check_file, looks_local
from areno.config.lora import check_lora_options
from areno.config.env import check_env_options, multi_turn, trajectory_tokens
from areno.config.offpolicy import check_off_policy
from areno.data.tasks.arith import DEMO_PRESET, demo_lora_preset
from areno.errors import UserError
from areno.rollout.factory import resolved_engine
from areno.models.directory import MODEL_DIR_FIX, check_model_dir

if TYPE_CHECKING:
    from areno.config.train import TrainConfig

# Authenticates the ranks' connections to the controller (runtime/multinode.py).
AUTHKEY_VAR = "ARENO_BACKEND_AUTHKEY"


def fill_demo_preset(values: dict[str, Any]) -> None:
    """No --ckpt and no --dataset-path: the demo's preset fills the keys not given
    (in place; values: the YAML's and the flags' keys)."""
    if values.get("ckpt") is None and values.get("dataset_path") is None:
        env = values.get("env_path") is not None or values.get("agent_path") is not None  # it is the reward
        if not env:
            values.setdefault("reward_fn_path", DEMO_PRESET["reward_fn_path"])
        # The demo scores its built-in reward in-process; a user's plugin may
        # hang, so it keeps the workers that enforce --reward-timeout.
        own_plugin = not str(values.get("reward_fn_path", "")).startswith("builtin:")
        lora = isinstance(values.get("lora_rank"), int) and values["lora_rank"] > 0
        # LoRA: its own targets, alpha and LR (arith.DEMO_LORA_PRESET: the frozen head caps the default)
        lora_preset = demo_lora_preset(float(values.get("lora_dropout") or 0.0)) if lora else {}
        for k, v in {**DEMO_PRESET, **lora_preset}.items():
            if not (own_plugin and k == "reward_workers") and not (env and k == "reward_fn_path"):
                values.setdefault(k, v)


def check_rules(cfg: TrainConfig) -> None:
    """Every rule between options, on a config whose values passed their own checks."""
    if cfg.ckpt is not None and looks_local(cfg.ckpt) and not Path(cfg.ckpt).is_dir():
        raise UserError(f"--ckpt: no model directory at {cfg.ckpt}")
    if cfg.ckpt is not None:  # a few small reads: a bad model is one line in a second
        check_model_dir(cfg.ckpt, "--ckpt", MODEL_DIR_FIX)
    if cfg.eval_only and cfg.eval_dataset_path is None:
        raise UserError("--eval-only needs --eval-dataset-path")
    if cfg.eval_dataset_path is not None and cfg.reward_fn_path is None and not multi_turn(cfg):
        raise UserError("--eval-dataset-path needs what scores it: --reward-fn-path (or --env-path, --agent-path)")
    if cfg.resume is not None and cfg.resume != "latest" and not Path(cfg.resume).is_dir():
        raise UserError(f"--resume: no checkpoint directory at {cfg.resume} "
                        "(give a checkpoint path or 'latest')")
    if cfg.ckpt is not None and cfg.dataset_path is None and not cfg.eval_only:
        raise UserError("--dataset-path is required with --ckpt (or leave both unset for the "
                        "embedded demo)")
    if cfg.dataset_path is not None and cfg.reward_fn_path is None and not multi_turn(cfg):
        raise UserError("--reward-fn-path is required with --dataset-path "
                        "(a .py file defining reward_fn or reward_fn_batch)")
    if cfg.reward_fn_path is not None and not cfg.reward_fn_path.startswith("builtin:"):
        check_file("--reward-fn-path", cfg.reward_fn_path, suffix=".py")
    if cfg.dataset_loader_fn is not None:
        check_file("--dataset-loader-fn", cfg.dataset_loader_fn.split(":", 1)[0], suffix=".py")
    if cfg.resume is None:  # resuming: on the config in effect, by resume.resume_config
        check_off_policy(cfg)
    check_correction_options(cfg)
    check_engine_tp(cfg)
    check_env_options(cfg)
    if cfg.tis_cap is not None and cfg.recompute_logprobs is False:
        raise UserError("--tis-cap needs --recompute-logprobs (it weights the trainer/sampler "
                        "log-prob ratio)")
    if cfg.mini_batches > cfg.batch_size * cfg.n_samples:
        raise UserError(f"--mini-batches ({cfg.mini_batches}) exceeds the completions per "
                        f"step ({cfg.batch_size * cfg.n_samples})")
    if cfg.world_size and cfg.world_size > cfg.batch_size * cfg.n_samples:
        raise UserError(f"--world-size ({cfg.world_size}) exceeds the completions per step")
    if cfg.node_rank >= cfg.nnodes:
        raise UserError(f"--node-rank ({cfg.node_rank}) must be below --nnodes ({cfg.nnodes})")
    if cfg.nnodes > 1:
        check_authkey()
        if cfg.world_size and cfg.nproc_per_node and \
                cfg.world_size != cfg.nnodes * cfg.nproc_per_node:
            raise UserError(f"--world-size ({cfg.world_size}) must be --nnodes x "
                            f"--nproc-per-node ({cfg.nnodes} x {cfg.nproc_per_node})")
    check_lora_options(cfg)
    if cfg.n_samples < 2:  # every mode's baseline is the group's own reward
        raise UserError(f"--n-samples must be >= 2 for --adv-mode {cfg.adv_mode} (a group "
                        "of one has no baseline: every advantage would be 0)")


def check_engine_tp(cfg: TrainConfig) -> None:
    """--tensor-parallel-size > 1 needs vLLM: each rank of a TP group would
    otherwise run transformers' generate on the same prompts."""
    tp = cfg.tensor_parallel_size
    if tp <= 1 or resolved_engine(cfg.rollout_engine) != "hf":
        return
    if cfg.rollout_engine == "hf":
        raise UserError(f"--rollout-engine hf with --tensor-parallel-size {tp}: the transformers "
                        "engine has no tensor parallelism; drop --tensor-parallel-size or use "
                        "--rollout-engine vllm")
    raise UserError(f"--tensor-parallel-size {tp}: vLLM is not installed, and the transformers "
                    "engine --rollout-engine falls back to has no tensor parallelism; install vLLM "
                    "or drop --tensor-parallel-size")


def check_correction_options(cfg: TrainConfig) -> None:
    """--is-level, --is-mode, --is-mask-low, --dynamic-sampling and --overlong-buffer
    against what they need."""
    shaped = [f for f, on in ((f"--is-level {cfg.is_level}", cfg.is_level != "token"),
                              (f"--is-mode {cfg.is_mode}", cfg.is_mode != "truncate"),
                              (f"--is-mask-low {cfg.is_mask_low:g}", cfg.is_mask_low > 0)) if on]
    if shaped and cfg.tis_cap is None:
        raise UserError(f"{shaped[0]} needs --tis-cap (the importance weight it shapes; it also "
                        "needs --recompute-logprobs)")
    if cfg.is_mask_low > 0 and cfg.is_mode != "mask":
        raise UserError(f"--is-mask-low {cfg.is_mask_low:g} is the lower edge of --is-mode mask's "
                        f"band; with --is-mode {cfg.is_mode} nothing is masked: add --is-mode mask")
    if cfg.tis_cap is not None and cfg.is_mask_low >= cfg.tis_cap:
        raise UserError(f"--is-mask-low {cfg.is_mask_low:g} must be below --tis-cap "
                        f"{cfg.tis_cap:g} (the band would keep no token)")
    if cfg.overlong_buffer > trajectory_tokens(cfg):
        what = ("--max-new-tokens", "completion") if not multi_turn(cfg) else \
            ("the trajectory budget (--max-trajectory-tokens)", "trajectory")
        raise UserError(f"--overlong-buffer {cfg.overlong_buffer} exceeds {what[0]} "
                        f"{trajectory_tokens(cfg)}: every {what[1]} would be punished; lower it")


def check_reward_timeout(given: dict[str, Any]) -> None:
    """--reward-timeout with --reward-workers 0, both given: in-process scoring
    has no process to kill, so the timeout could only be ignored (issue 18)."""
    if given.get("reward_workers") == 0 and given.get("reward_timeout") is not None:
        raise UserError(f"--reward-timeout {given['reward_timeout']} cannot be enforced with "
                        "--reward-workers 0 (in-process scoring has no worker to kill): give "
                        "--reward-workers 1 or more, or drop --reward-timeout")


def check_authkey() -> None:
    key = os.environ.get(AUTHKEY_VAR, "")
    try:
        ok = len(bytes.fromhex(key)) >= 16
    except ValueError:
        ok = False
    if not ok:
        raise UserError(
            f"--nnodes > 1 needs {AUTHKEY_VAR}, the same on every node (32 hex digits): "
            f"export {AUTHKEY_VAR}=$(python -c 'import secrets; print(secrets.token_hex(16))')")
