"""Claiming a peer's device: the one device call of a rank's or an engine
process's start-up (torch is imported inside, so the process layer stays
torch-free until a peer claims), and the CPU cores each CPU peer takes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def claim_device(device: str, cpu_threads: int, index: int, local_procs: int) -> torch.device:
    """This process's torch device, made current: cuda:index (the one device call of
    a rank's or an engine process's start-up; everything before it is the same
    code on CPU and GPU), or the CPU with this process's share of the cores
    (`cpu_threads`, else rank_cpu_threads over `local_procs` processes;
    BackendConfig.device and .cpu_threads)."""
    import torch

    if device == "cuda":
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        return dev
    torch.set_num_threads(cpu_threads or rank_cpu_threads(len(os.sched_getaffinity(0)), local_procs))
    return torch.device("cpu")


def rank_cpu_threads(cpus: int, local_ranks: int) -> int:
    """torch threads for each of `local_ranks` CPU ranks on `cpus` cores: the
    cores split among the ranks, every core used (torch's own default is every
    core per process). The ranks' OpenMP threads wait passively (RANK_OMP_ENV;
    a short spin only when nothing else was runnable at start-up, rank_omp_env),
    which is what makes every core safe next to other work: with the default
    spin-wait, a thread that shared a core with a busy process spun at each
    barrier until its partner got a core back, and the demo's step went from
    34 ms to 359 ms at 2 threads on 2 cores (issue 17), so issue 17 left one core
    free, (cpus - 1) / ranks, which cost the idle real model 1.3-1.75x on 2 cores
    (issue 26, 7; docs/PERFORMANCE.md, scripts/bench_busy.py)."""
    return max(1, cpus // max(1, local_ranks))
