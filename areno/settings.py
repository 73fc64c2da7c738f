"""TrainConfig -> the settings of the parts a run builds: the torch backend
(`BackendConfig`, with its `LossConfig`), the rollout engine every rank holds
(`EngineSpec`) and rollout sampling (`SamplingConfig`).

Apart from config.py because these types import torch, which config.py (read
by the controller before it validates anything) must not.
"""

from __future__ import annotations

import os

from areno.config.env import trajectory_tokens
from areno.backend.config import BackendConfig, LoraSpec, engine_gpus_from_env
from areno.config.train import TrainConfig
from areno.config.lora import adapter_settings, check_lora_tp, lora_targets
from areno.errors import UserError
from areno.models.directory import adapter_config
from areno.procs.device import rank_cpu_threads
from areno.losses import LossConfig
from areno.rollout.engine import SamplingConfig
from areno.rollout.factory import GPU_MEMORY_COLOCATED, GPU_MEMORY_DEDICATED, EngineSpec
from areno.rundir.log import ENV as RUN_LOG_ENV


def resolved_dtype(cfg: TrainConfig, device: str) -> str:
    """--dtype, with auto resolved: bfloat16 on GPU, float32 on CPU."""
    return cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


# Dtypes whose sampler and trainer kernels disagree enough to clip at K = 0:
# SmolLM2 in bf16 on CPU (vLLM against torch), step 1 before any update, 0.46% of
# tokens clipped, ratio std 0.052; in fp32 the ratio stays within 3e-5 of 1
# (docs/PERFORMANCE.md, scripts/bench_ratio_noise.py).
NOISY_DTYPES = ("bfloat16", "float16")


def old_logprobs(cfg: TrainConfig, device: str) -> tuple[bool, float | None]:
    """(the trainer's old log-probs?, --tis-cap): --recompute-logprobs unset is on
    in a half dtype (or with --tis-cap given), and then weighs the sampler's
    mismatch with truncated IS at OFF_POLICY_TIS_CAP unless --tis-cap says otherwise."""
    from areno.config.offpolicy import OFF_POLICY_TIS_CAP

    if cfg.recompute_logprobs is not None:
        return cfg.recompute_logprobs, cfg.tis_cap
    on = resolved_dtype(cfg, device) in NOISY_DTYPES or cfg.tis_cap is not None
    return on, cfg.tis_cap if cfg.tis_cap is not None or not on else OFF_POLICY_TIS_CAP


def old_logprobs_note(cfg: TrainConfig, device: str) -> str:
    """The start line's note when old log-probs default to the trainer's, else ''."""
    on, cap = old_logprobs(cfg, device)
    if cfg.recompute_logprobs is not None or not on:
        return ""
    one = cfg.mini_batches * cfg.ppo_epochs == 1
    when = "its own, detached" if one else "recomputed before the first update"
    return (f"; old log-probs: the trainer's ({when}), the sampler's mismatch a truncated-IS weight "
            f"(--tis-cap {cap:g})")


def sampling(cfg: TrainConfig) -> SamplingConfig:
    """How responses are sampled; each step and each evaluation sets its own seed."""
    return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_new_tokens)


def engine_spec(cfg: TrainConfig, device: str, max_prompt_len: int, lora_rank: int = 0) -> EngineSpec:
    """The rollout engine every rank builds beside its policy (lora_rank > 0: it
    serves the ranks' adapters of that rank over the base model)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM logs several lines per weight push at INFO/WARNING; the step line is ours.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # At least 64: the weight-sync probe is scored as one prompt.
    # Only the default engine (unset) may fall back to transformers (factory.make_engine).
    return EngineSpec(kind=cfg.rollout_engine or "vllm", fallback=cfg.rollout_engine is None,
                      dtype=resolved_dtype(cfg, device), seed=cfg.seed,
                      max_model_len=max(max_prompt_len + trajectory_tokens(cfg), 64),
                      tensor_parallel_size=cfg.tensor_parallel_size,
                      gpu_memory_utilization=engine_gpu_memory(cfg),
                      kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)), max_lora_rank=lora_rank)


def engine_gpu_memory(cfg: TrainConfig) -> float:
    """--gpu-memory-utilization, or its default by placement: an engine process of
    its own (--rollout-world-size) has its GPU to itself, a colocated engine
    shares it with training (and sleeps while the rank trains)."""
    if cfg.gpu_memory_utilization is not None:
        return cfg.gpu_memory_utilization
    return GPU_MEMORY_DEDICATED if cfg.rollout_world_size else GPU_MEMORY_COLOCATED


def backend_config(cfg: TrainConfig, model_path: str, base_model: str, world_size: int,
                   device: str, total_steps: int, engine: EngineSpec | None = None,
                   lora: LoraSpec | None = None) -> BackendConfig:
    """The backend's settings. model_path: the policy to load (a checkpoint when
    resuming); base_model: the reference model; total_steps: rollout steps of the
    run (the LR schedule counts optimizer steps); lora: lora_spec's (under LoRA
    model_path is the base model, the adapter is lora.adapter_path)."""
    low, high = cfg.loss_eps()
    recompute, tis_cap = old_logprobs(cfg, device)
    loss = LossConfig(algo=cfg.algo, clip_eps_low=low, clip_eps_high=high, kl_coef=cfg.kl_coef,
                      kl_type=cfg.kl_type, entropy_coef=cfg.entropy_coef, tis_cap=tis_cap,
                      clip_ratio_c=cfg.clip_ratio_c, is_level=cfg.is_level, is_mode=cfg.is_mode,
                      is_mask_low=cfg.is_mask_low)
    return BackendConfig(
        model_path=model_path, world_size=world_size, device=device, dtype=resolved_dtype(cfg, device),
        strategy=cfg.strategy, lr=cfg.lr, weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps * cfg.mini_batches * cfg.ppo_epochs,
        min_lr_ratio=cfg.min_lr_ratio, max_grad_norm=cfg.max_grad_norm or None,
        grad_checkpointing=cfg.grad_checkpointing, ppo_epochs=cfg.ppo_epochs,
        recompute_logprobs=recompute, loss=loss, temperature=cfg.temperature,
        max_nan_steps=cfg.max_nan_steps,
        seed=cfg.seed, ref_model_path=base_model, engine=engine, cpu_threads=cpu_threads(cfg, device, world_size),
        heartbeat_timeout_s=cfg.rank_heartbeat_timeout, startup_timeout_s=cfg.startup_timeout,
        command_timeout_s=cfg.command_timeout, collective_timeout_s=cfg.collective_timeout, lora=lora,
        rollout_world_size=cfg.rollout_world_size,
        engine_gpus=engine_gpus(cfg, device), run_log=os.environ.get(RUN_LOG_ENV, ""),
    )


def cpu_threads(cfg: TrainConfig, device: str, world_size: int) -> int | None:
    """torch threads of each CPU rank and engine process (BackendConfig.cpu_threads):
    --cpu-threads, else None (each picks rank_cpu_threads over its own kind), unless
    engine processes generate while the ranks train (K >= 1, one node): then the
    cores are split among the ranks and the engine processes. Two processes'
    OpenMP threads on one core wait for each other at every barrier: SmolLM2's
    train phase took 33 s beside a generating vLLM engine at 2 threads on 2 cores,
    17 s at 1 (docs/PERFORMANCE.md, bench_async --partial-smol). At K = 0 they
    take turns, and each keeps every core."""
    if cfg.cpu_threads or device != "cpu" or not (cfg.rollout_world_size and cfg.off_policy_steps):
        return cfg.cpu_threads
    return rank_cpu_threads(len(os.sched_getaffinity(0)), world_size + cfg.rollout_world_size)


def engine_gpus(cfg: TrainConfig, device: str) -> tuple[int, ...]:
    """Where split placement's engine processes go on GPU (ARENO_ENGINE_GPUS; ()
    is GPU N + i): BackendConfig.engine_gpus."""
    return engine_gpus_from_env(os.environ) if cfg.rollout_world_size and device == "cuda" else ()


def lora_spec(cfg: TrainConfig, adapter: str | None = None) -> LoraSpec | None:
    """The LoRA adapters the ranks train (None: full fine-tuning). adapter: a saved
    adapter directory to start from (a LoRA checkpoint being resumed or evaluated);
    its adapter_config.json then says rank, alpha, dropout, targets and rsLoRA
    (config.lora.adapter_settings, which refuses what areno would not serve exactly)."""
    if adapter is not None:
        fields = adapter_settings(adapter_config(adapter) or {}, adapter)
        r = fields["rank"]
        if cfg.lora_rank and cfg.lora_rank != r:
            raise UserError(f"--lora-rank {cfg.lora_rank}: the adapter at {adapter} has rank {r}; "
                            f"drop --lora-rank (or give {r})")
        check_lora_tp(cfg.tensor_parallel_size)
        return LoraSpec(**fields, adapter_path=str(adapter), save_merged=cfg.save_merged)
    if cfg.lora_rank == 0:
        return None
    return LoraSpec(rank=cfg.lora_rank, alpha=float(cfg.lora_alpha or 2 * cfg.lora_rank),
                    dropout=cfg.lora_dropout, target_modules=lora_targets(cfg.lora_target_modules),
                    save_merged=cfg.save_merged)
