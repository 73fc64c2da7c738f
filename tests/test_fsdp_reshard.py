"""The reference model is sharded again after its no-grad forward under FSDP2
(issue 17, 2g): FSDP2 keeps a root unsharded after forward for the backward
that would follow, which never comes for the reference model, so its
embeddings, final norm and lm_head stayed gathered on every rank for the whole
update. Two gloo ranks on CPU, bf16 mixed precision as on GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.backend.controller import free_port

WORLD = 2


def _unsharded_after_ref_forward(rank: int, path: str, port: int, out: str) -> None:
    """One rank: the reference model wrapped as the worker wraps it, one no-grad
    log-prob pass, then the names of its parameters that are not DTensor shards."""
    from torch.distributed.tensor import DTensor

    from areno.backend.config import BackendConfig
    from areno.backend.model import PolicyModule, load_hf_model, wrap_policy
    from areno.backend.step import no_grad_logprobs, to_device
    from test_backend_units import make_split

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = BackendConfig(model_path=path, world_size=WORLD, dtype="bfloat16")
        hf = load_hf_model(path, "sdpa", torch.device("cpu"))
        hf.requires_grad_(False)
        ref = wrap_policy(PolicyModule(hf, 64), cfg, torch.device("cpu"), trainable=False)
        assert ref.strategy == "fsdp2"
        split = make_split(WORLD, num_minibatches=1)
        micros = [[to_device(split.micro(rank, 0, m), torch.device("cpu")) for m in range(split.num_micro)]]
        lps = no_grad_logprobs(ref, cfg, micros)
        names = [n for n, p in ref.policy.named_parameters() if not isinstance(p, DTensor)]
        again = no_grad_logprobs(ref, cfg, micros)  # gathers afresh from the shards
        same = all(torch.equal(a, b) for ra, rb in zip(lps, again) for a, b in zip(ra, rb))
        finite = all(bool(lp.isfinite().all()) for row in lps for lp in row)
        Path(out, f"{rank}.json").write_text(json.dumps({"unsharded": names, "finite": finite, "same": same}))
    finally:
        dist.destroy_process_group()


def test_reference_model_is_sharded_again_after_its_no_grad_forward(tiny_chat_path, tmp_path) -> None:
    mp.spawn(_unsharded_after_ref_forward, args=(str(tiny_chat_path), free_port(), str(tmp_path)),
             nprocs=WORLD, join=True)
    for r in range(WORLD):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["finite"] and got["same"]
        assert got["unsharded"] == [], f"rank {r}: {got['unsharded']} still gathered after the ref forward"
