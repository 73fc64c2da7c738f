"""The one place rollout engines are built: `EngineSpec` (what every rank's
engine is made of) and `make_engine`. Imports vLLM or transformers only when
it builds one, so the controller can import this module."""

from __future__ import annotations

import importlib.util
import os
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from areno.errors import UserError

EngineKind = Literal["vllm", "hf"]
# vLLM's default share of its GPU: beside a training rank (it sleeps while the
# rank trains), and in an engine process of split placement, alone on its GPU.
GPU_MEMORY_COLOCATED = 0.5
GPU_MEMORY_DEDICATED = 0.9
ENGINE_KINDS: tuple[str, ...] = typing.get_args(EngineKind)
# The vLLM releases areno runs against: the one the suite runs (pyproject's
# `vllm` and `cpu` extras pin it; tests/test_install_pins.py). Older ones lack
# LLM.enqueue and reload_weights(weights_iterator=), which areno calls without a
# fallback; newer ones pull a torch and transformers no test has run.
VLLM_SUPPORTED = ("0.32.0", "0.33")  # >= first, < second
# vLLM 0.32+ picks its V2 model runner on a GPU (wherever Triton imports); the
# suite runs V1 only (no Triton on CPU), so areno asks for V1 unless this is set.
VLLM_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@dataclass(frozen=True)
class EngineSpec:
    """What each rank's engine is built with.

    kind: "vllm" or "hf". fallback: with kind "vllm", build "hf" where vLLM does not
    import (the CLI's default engine); False: that is a UserError (--rollout-engine
    vllm was given, and a user on a GPU must not train at transformers' speed unawares).
    dtype: "float32" | "bfloat16": the engine's weights and compute.
    max_model_len: prompt + response tokens. tensor_parallel_size: ranks per engine.
    gpu_memory_utilization: vLLM's GPU share (GPU only). kv_cache_bytes: vLLM's KV
    cache on CPU. max_lora_rank: > 0 serves a LoRA adapter of rank up to it
    (`load_adapter`: rollout.vllm_lora, rollout.hf_lora); 0 is no LoRA.
    """

    kind: EngineKind = "vllm"
    fallback: bool = True
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = GPU_MEMORY_COLOCATED
    kv_cache_bytes: int = 256 << 20
    max_lora_rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"unknown rollout engine {self.kind!r}; valid: {', '.join(ENGINE_KINDS)}")
        if self.max_lora_rank < 0:
            raise ValueError(f"max_lora_rank must be >= 0 (0: no LoRA), got {self.max_lora_rank}")


def make_engine(spec: EngineSpec, model_path: str, device: Any = "cpu", *, in_rank: bool = False,
                ) -> tuple[Any, str]:
    """-> (engine, the kind actually built). in_rank: inside a training rank whose
    torch world is already formed (vLLM joins it with external_launcher)."""
    if spec.kind == "vllm":
        try:
            return _vllm(spec, model_path, str(device).startswith("cuda"), in_rank), "vllm"
        except ImportError as e:
            if not spec.fallback:
                raise UserError(f"--rollout-engine vllm: vLLM does not import here ({e}); install it "
                                "(pip install areno[vllm] on GPU, areno[cpu] on CPU) or use "
                                "--rollout-engine hf") from None
            if spec.tensor_parallel_size > 1:  # vLLM installed but broken: the config saw it installed
                raise UserError(f"--tensor-parallel-size {spec.tensor_parallel_size}: vLLM does not "
                                f"import here ({e}) and the transformers engine has no tensor "
                                "parallelism; install vLLM or drop --tensor-parallel-size") from None
            warnings.warn(f"vLLM is not importable ({e}); sampling with the transformers engine "
                          "(slow). Install it with `pip install areno[vllm]` (GPU) or `areno[cpu]`.",
                          stacklevel=2)
    from areno.rollout.hf import HFEngine

    return HFEngine(model_path, dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len,
                    device=device, max_lora_rank=spec.max_lora_rank), "hf"


def _vllm(spec: EngineSpec, model_path: str, on_gpu: bool, in_rank: bool) -> Any:
    kw: dict[str, Any] = dict(tensor_parallel_size=spec.tensor_parallel_size, dtype=spec.dtype,
                              seed=spec.seed, max_model_len=spec.max_model_len,
                              max_lora_rank=spec.max_lora_rank)
    # In-process engine core on every device and placement: load_weights hands the
    # worker tensors, which only an engine in this process can take (a GPU's
    # default is a separate engine-core process).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if in_rank:
        # The engine runs inside the torch world the ranks formed (TP groups of consecutive ranks).
        kw["distributed_executor_backend"] = "external_launcher"
    if on_gpu:
        kw.update(gpu_memory_utilization=spec.gpu_memory_utilization, enable_sleep_mode=True)
    else:
        kw.update(kv_cache_memory_bytes=spec.kv_cache_bytes)
    from areno.rollout.vllm import VLLMEngine

    return VLLMEngine(model_path, **kw)


def check_vllm_version(version: str) -> None:
    """UserError unless `version` (vllm.__version__) is in VLLM_SUPPORTED."""
    from packaging.version import Version

    low, high = VLLM_SUPPORTED
    if not Version(low) <= Version(Version(version).base_version) < Version(high):
        raise UserError(f"vLLM {version} is installed; areno runs vLLM >= {low}, < {high} "
                        f"(pip install -e '.[vllm]' on GPU, '.[cpu]' on CPU, installs vllm=={low})")


def select_vllm_runner() -> str:
    """Ask vLLM for its V1 model runner unless VLLM_USE_V2_MODEL_RUNNER is set
    (vLLM reads it when the engine is built) -> "V1" | "V2", what was asked."""
    os.environ.setdefault(VLLM_RUNNER_ENV, "0")
    return "V1" if os.environ[VLLM_RUNNER_ENV].strip() == "0" else "V2"


def resolved_engine(kind: str | None) -> str:
    """The engine --rollout-engine kind builds: the one given; unset, vLLM, or
    transformers where vLLM is not installed (make_engine's fallback; found
    without importing vLLM, so the config can be checked in a second)."""
    if kind is not None:
        return kind
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
