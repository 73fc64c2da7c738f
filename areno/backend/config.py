"""BackendConfig: every knob of the torch backend, in one frozen dataclass.

The CLI's TrainConfig builds one of these; nothing else declares backend knobs.
Checks run in `__post_init__`, in the controller, before any rank is spawned.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from areno.choices import Device, DType, Strategy  # light: TrainConfig names them too
from areno.fleet.engine_procs import EngineProcsConfig
from areno.rollout.factory import EngineSpec
from areno.losses import LossConfig

AttnImpl = Literal["auto", "varlen", "flash_attention_2", "flex", "sdpa", "eager"]
Launcher = Literal["spawn", "external"]


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the policy (backend/lora.py); the base weights stay frozen."""

    rank: int
    """r: the adapters' inner dimension (> 0)."""
    alpha: float
    """Scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input during the update (0 = none)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Leaf names of the decoder layers' linears to adapt; ('all-linear',) = all of them
    (attention and MLP); 'lm_head' beside them adapts an untied lm_head too
    (backend.lora.head_weight); never the embeddings."""
    adapter_path: str | None = None
    """A saved adapter directory to start from (resume, an adapter --ckpt); None = fresh (B = 0)."""
    save_merged: bool = False
    """Checkpoints also hold the merged full model in HF format, in merged/."""
    use_rslora: bool = False
    """rsLoRA's scaling alpha / sqrt(rank) instead of alpha / rank (an adapter from
    another tool that says so: config.lora.adapter_settings)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"backend.lora.rank: must be >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"backend.lora.alpha: must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"backend.lora.dropout: must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("backend.lora.target_modules: must name at least one module")


DEVICES: tuple[str, ...] = typing.get_args(Device)
DTYPES: tuple[str, ...] = typing.get_args(DType)
STRATEGIES: tuple[str, ...] = typing.get_args(Strategy)
ATTN_IMPLS: tuple[str, ...] = typing.get_args(AttnImpl)
LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)


@dataclass(frozen=True)
class BackendConfig:
    """Torch backend settings. Units in the comments; defaults are CPU-safe."""

    model_path: str
    """HF model directory (or hub id already in the local cache) of the policy."""
    world_size: int = 1
    """Data-parallel ranks (one process per GPU; on CPU, gloo processes)."""
    device: Device = "cpu"
    """'cuda': NCCL, one GPU per rank (cuda:LOCAL_RANK). 'cpu': gloo."""
    dtype: DType = "float32"
    """Compute dtype. 'bfloat16': FSDP2 gathers bf16 params and reduces gradients
    in fp32 (on CPU under gloo too); master weights and optimizer state stay fp32."""
    strategy: Strategy = "auto"
    """'fsdp2' (fully_shard per decoder layer + root), 'ddp', or 'auto': fsdp2 on
    more than one rank (FSDP2 works under gloo on CPU too, so CPU tests run the
    GPU code path), and the plain module on one rank ('single'), where a wrapper
    has nothing to shard or reduce and its hooks only cost time."""
    attn_implementation: AttnImpl = "auto"
    """Packed attention kernel (backend/attention.py), each computing only
    within-sequence blocks from the pack's cu_seqlens: 'varlen' (torch's flash
    varlen, CUDA), 'flash_attention_2' (flash-attn, CUDA), 'flex' (FlexAttention
    document mask), 'sdpa' (one causal sdpa per sequence), 'eager' (debugging).
    'auto': flash_attention_2 if flash_attn imports, else varlen, else flex on
    CUDA; sdpa on CPU."""

    compile_layers: bool = False
    """torch.compile each decoder layer (`layer.compile()`, before FSDP2 wraps it).
    The first train call pays the compile warm-up."""

    # optimizer and schedule
    lr: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps to lr over this many optimizer steps."""
    total_steps: int | None = None
    """Optimizer steps of the whole run for the cosine decay; None = constant after warmup."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient L2 norm to this; None = no clipping (norm still reported)."""
    grad_checkpointing: bool = False
    """Recompute decoder-layer activations in backward (less memory, ~30% more compute;
    model.checkpoint_layers: the policy stays in eval mode)."""

    # the RL update
    ppo_epochs: int = 1
    """Passes over each rollout batch; every mini-batch of every epoch is one optimizer step."""
    recompute_logprobs: bool = False
    """Before the first update, recompute old log-probs with the trainer (no grad) and
    use them as old_logprobs; the sampler's stay as rollout_logprobs (TIS, logprob_diff)."""
    loss: LossConfig = field(default_factory=LossConfig)
    ref_model_path: str | None = None
    """Reference model for KL; loaded only when loss.kl_coef > 0 (None = model_path)."""
    temperature: float = 1.0
    """The sampler's temperature: training log-probs (policy, old, reference, entropy)
    are those of logits / temperature, the distribution the tokens were sampled from."""
    lora: LoraSpec | None = None
    """LoRA adapters (None: full fine-tuning). With kl_coef > 0 the reference
    log-probs come from the same model with its adapters off: no second model."""
    logprob_chunk_size: int = 4096
    """Positions per lm_head chunk: fp32 logits exist for at most this many positions."""
    max_nan_steps: int = 3
    """A non-finite loss or grad norm skips the step; this many in a row stop the run."""
    seed: int = 0

    # rollout
    engine: EngineSpec | None = None
    """Each rank builds this rollout engine beside its policy (None: no engine;
    rollouts come from elsewhere and weights leave through publish_weights)."""
    rollout_world_size: int = 0
    """Split placement: this many engine processes (fleet/engine_procs.py, apart
    from the ranks: engine_procs()) build `engine` instead of the ranks; 0 =
    colocated (every rank builds its own)."""
    engine_gpus: tuple[int, ...] = ()
    """Split placement on GPU: the GPU of each engine process, as an index into the
    controller's visible GPUs; () = N + i, the GPUs after the ranks'. Sharing a
    rank's GPU is for checks on one GPU (ENGINE_GPUS_ENV, scripts/gpu_check.sh)."""

    # processes
    launcher: Launcher = "spawn"
    """'spawn': the controller starts world_size local ranks. 'external': ranks are
    started by torchrun (`python -m areno.backend.rank --connect HOST:PORT`) and dial in."""
    listen_host: str = "0.0.0.0"
    """external launcher: address the controller listens on for ranks."""
    listen_port: int = 29600
    """external launcher: port the controller listens on."""
    master_addr: str = "127.0.0.1"
    """spawn launcher: torch.distributed rendezvous address (MASTER_ADDR)."""
    master_port: int | None = None
    """spawn launcher: rendezvous port; None = a free port."""
    cpu_threads: int | None = None
    """torch threads per rank on CPU; None = `procs.device.rank_cpu_threads` of this host."""
    startup_timeout_s: float = 1800.0
    """Seconds for all ranks to load the model and report ready (--startup-timeout: a
    cold GPU start compiles vLLM and captures CUDA graphs in every rank)."""
    command_timeout_s: float = 3600.0
    """Seconds one train/export/save call may take before the backend is torn down
    (--command-timeout)."""
    collective_timeout_s: float = 1800.0
    """torch.distributed process-group timeout (a stuck collective errors after this;
    --collective-timeout: rank 0 writes a checkpoint while the others wait)."""
    heartbeat_timeout_s: float = 0.0
    """Seconds a spawned rank may send no heartbeat (stopped, frozen) before the run
    stops; 0 = max(30 s, 3 x the longest gap between its beats so far)."""
    shutdown_grace_s: float = 5.0
    """Seconds a rank gets to exit after the "shutdown" message before SIGKILL."""
    run_log: str = ""
    """The run's run.log ("": the terminal, --verbose): a rank started before the
    run directory existed moves its output there (runtime/early.py)."""

    def __post_init__(self) -> None:
        def bad(name: str, value: object, want: str) -> None:
            raise ValueError(f"backend.{name}: {want}, got {value!r}")

        for name, allowed in (
            ("device", DEVICES), ("dtype", DTYPES), ("strategy", STRATEGIES),
            ("attn_implementation", ATTN_IMPLS), ("launcher", LAUNCHERS),
        ):
            if getattr(self, name) not in allowed:
                bad(name, getattr(self, name), f"expected one of {', '.join(allowed)}")
        if not self.model_path:
            bad("model_path", self.model_path, "must name a model directory")
        if self.world_size < 1:
            bad("world_size", self.world_size, "must be >= 1")
        if not self.lr > 0:
            bad("lr", self.lr, "must be > 0")
        if self.weight_decay < 0:
            bad("weight_decay", self.weight_decay, "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", self.betas, "must be two numbers in [0, 1)")
        if self.warmup_steps < 0:
            bad("warmup_steps", self.warmup_steps, "must be >= 0")
        if self.total_steps is not None and self.total_steps < 1:
            bad("total_steps", self.total_steps, "must be None or >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            bad("max_grad_norm", self.max_grad_norm, "must be None or > 0")
        if self.ppo_epochs < 1:
            bad("ppo_epochs", self.ppo_epochs, "must be >= 1")
        if self.logprob_chunk_size < 1:
            bad("logprob_chunk_size", self.logprob_chunk_size, "must be >= 1")
        if self.max_nan_steps < 1:
            bad("max_nan_steps", self.max_nan_steps, "must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            bad("cpu_threads", self.cpu_threads, "must be None or >= 1")
        for name in ("startup_timeout_s", "command_timeout_s", "collective_timeout_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                bad(name, getattr(self, name), "must be > 0")
        if self.rollout_world_size < 0 or (self.rollout_world_size and self.engine is None):
            bad("rollout_world_size", self.rollout_world_size, "must be >= 0, and > 0 only with an engine")
        if self.engine_gpus and (len(self.engine_gpus) != self.rollout_world_size or min(self.engine_gpus) < 0):
            bad("engine_gpus", self.engine_gpus, f"must name {self.rollout_world_size} GPU index(es) >= 0")
        if self.rollout_world_size and self.launcher != "spawn":
            bad("rollout_world_size", self.rollout_world_size, "engine processes need launcher='spawn'")
        colocated = self.engine is not None and not self.rollout_world_size
        if colocated and self.world_size % self.engine.tensor_parallel_size:
            bad("engine.tensor_parallel_size", self.engine.tensor_parallel_size,
                f"must divide world_size {self.world_size}")
        if self.device == "cpu" and self.attn_implementation in ("flash_attention_2", "varlen", "flex"):
            # flex runs forward on CPU, but torch 2.13 has no CPU backward for it
            bad("attn_implementation", self.attn_implementation, f"{self.attn_implementation} needs device='cuda'")
        if self.dtype == "float32" and self.attn_implementation in ("flash_attention_2", "varlen"):
            # flash kernels take fp16/bf16 only; auto picks flex for fp32 on CUDA
            bad("attn_implementation", self.attn_implementation,
                f"{self.attn_implementation} needs dtype='bfloat16' (flash kernels have no fp32)")

    def strategy_for(self, world_size: int) -> str:
        """'auto' -> 'fsdp2' on several ranks, 'single' (no wrapper) on one."""
        if self.strategy != "auto":
            return self.strategy
        return "fsdp2" if world_size > 1 else "single"

    def engine_procs(self) -> EngineProcsConfig:
        """The engine processes' own config (split placement): the engine, where
        they go, and the same bounds as the ranks'."""
        return EngineProcsConfig(
            count=self.rollout_world_size, model_path=self.model_path, engine=self.engine, ranks=self.world_size,
            device=self.device, engine_gpus=tuple(self.engine_gpus), cpu_threads=self.cpu_threads,
            startup_timeout_s=self.startup_timeout_s, command_timeout_s=self.command_timeout_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s, shutdown_grace_s=self.shutdown_grace_s,
            run_log=self.run_log)

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def needs_ref_model(self) -> bool:
        return self.loss.kl_coef > 0 and self.lora is None  # LoRA: the adapters-off model


# Where split placement's engine processes go on GPU (BackendConfig.engine_gpus),
# as a comma list of GPU indices: a lever for checks on one GPU, not a CLI option.
ENGINE_GPUS_ENV = "ARENO_ENGINE_GPUS"


def engine_gpus_from_env(environ: typing.Mapping[str, str]) -> tuple[int, ...]:
    """ENGINE_GPUS_ENV's indices; () when unset (the GPUs after the ranks')."""
    raw = environ.get(ENGINE_GPUS_ENV, "").strip()
    try:
        return tuple(int(x) for x in raw.split(",")) if raw else ()
    except ValueError:
        raise ValueError(f"{ENGINE_GPUS_ENV}={raw!r}: expected GPU indices such as 0 or 0,1") from None
