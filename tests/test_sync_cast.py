"""A weight sync into bf16 engines gathers bf16 shards, not the fp32 masters
(half the collective's bytes), and sends exactly what gather-then-cast sent:
the same tensors bit for bit, so the same fingerprint. Two gloo ranks under
FSDP2 on CPU, the engines' dtype bf16 over fp32 masters as on a GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areno.backend.controller import free_port

WORLD = 2


def _gathered_dtypes(rank: int, path: str, port: int, out: str) -> None:
    """One rank: what each gather of a sync moves (DTensor.full_tensor's input
    dtype, recorded) and whether its tensors and fingerprint equal gather-then-cast."""
    from torch.distributed.tensor import DTensor

    from areno.backend.config import BackendConfig
    from areno.backend.model import PolicyModule, load_hf_model, wrap_policy
    from areno.fleet.weight_sync import WeightStream
    from areno.backend.weights import hf_state_names, iter_full_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = BackendConfig(model_path=path, world_size=WORLD, dtype="bfloat16")
        hf = load_hf_model(path, "sdpa", torch.device("cpu"))
        names = hf_state_names(hf)
        wrapped = wrap_policy(PolicyModule(hf, 64), cfg, torch.device("cpu"))
        assert wrapped.strategy == "fsdp2"
        moved: list[str] = []
        gather = DTensor.full_tensor

        def recording(self, *a, **k):
            moved.append(str(self.dtype))
            return gather(self, *a, **k)

        DTensor.full_tensor = recording
        try:
            cast_first = WeightStream(iter_full_state(hf, names, torch.bfloat16), torch.bfloat16)
            sent = [(n, t.clone()) for n, t in cast_first]
            masters = moved[:]
            moved.clear()
            gathered_first = WeightStream(iter_full_state(hf, names), torch.bfloat16)
            before = [(n, t.clone()) for n, t in gathered_first]
        finally:
            DTensor.full_tensor = gather
        same = [n for (n, a), (_, b) in zip(sent, before) if a.dtype == b.dtype and torch.equal(a, b)]
        Path(out, f"{rank}.json").write_text(json.dumps({
            "cast_first": masters, "gather_first": moved, "same": len(same), "total": len(names),
            "fingerprint_equal": cast_first.fingerprint().sums == gathered_first.fingerprint().sums}))
    finally:
        dist.destroy_process_group()


def test_a_sync_casts_the_shards_before_their_gather_and_sends_the_same_bits(tiny_chat_path, tmp_path):
    mp.spawn(_gathered_dtypes, args=(str(tiny_chat_path), free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for r in range(WORLD):
        got = json.loads((tmp_path / f"{r}.json").read_text())
        assert got["gather_first"] and set(got["gather_first"]) == {"torch.float32"}  # the masters
        assert got["cast_first"] == ["torch.bfloat16"] * len(got["gather_first"]), got["cast_first"]
        assert got["same"] == got["total"] and got["fingerprint_equal"], got
