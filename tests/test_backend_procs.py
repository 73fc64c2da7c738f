"""TorchBackend end to end with real rank processes (gloo on CPU, tiny model).

Equivalence (1 rank == 2 ranks, FSDP2 == DDP), learning, weight export into a
real engine, checkpoint/resume. Failure paths are in test_backend_failures.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from areno.backend import BackendConfig, TorchBackend
from areno.procs.device import rank_cpu_threads
from areno.fleet.weight_sync import region_tensors
from helpers import list_segments
from rank_test_hooks import full_state_dict
from test_backend_units import make_split

LR = 1e-3


def rank_children() -> list[psutil.Process]:
    """Our live child processes, minus multiprocessing's resource tracker (a
    per-interpreter singleton, not a rank)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_clean() -> None:
    assert rank_children() == []
    assert list_segments(os.getpid()) == []


def config(path, world_size: int, **kw) -> BackendConfig:
    return BackendConfig(model_path=str(path), world_size=world_size, lr=LR, seed=0, **kw)


def assert_states_close(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def first_step(tiny_chat_path):
    """Two backends on auto (1 and 2 ranks) after one train call on the same
    rollout batch; yields (be1, be2, state1, state2, metrics1, metrics2)."""
    be1 = TorchBackend(config(tiny_chat_path, 1))
    be2 = TorchBackend(config(tiny_chat_path, 2))
    try:
        m1 = be1.train(make_split(1))
        m2 = be2.train(make_split(2))
        yield be1, be2, full_state_dict(be1), full_state_dict(be2), m1, m2
    finally:
        be1.close()
        be2.close()
    assert_clean()


def test_one_rank_and_two_ranks_make_the_same_update(first_step, tiny_chat_model) -> None:
    """'auto' is the plain module on one rank and FSDP2 on two: the same update."""
    be1, be2, s1, s2, m1, m2 = first_step
    assert (be1.strategy, be2.strategy) == ("single", "fsdp2")
    cpus = len(os.sched_getaffinity(0))
    assert [h["cpu_threads"] for h in be2.hellos] == [rank_cpu_threads(cpus, 2)] * 2
    for p in be2._procs:  # OpenMP reads its wait policy at start-up: the rank must start with it
        start_env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p.pid}/environ").read_text().split("\0") if "=" in kv)
        assert start_env.get("OMP_WAIT_POLICY") == os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), p.pid
    assert be2.command("gc_state") == [True, True]  # on again after start-up (procs.lifecycle.start_up)
    assert_states_close(s1, s2)
    start = tiny_chat_model.state_dict()
    assert any(not torch.equal(s1[k], start[k]) for k in start), "weights did not move"
    for a, b in zip(m1, m2):
        for k in ("loss", "grad_norm", "clip_frac", "num_tokens", "loss_tokens", "entropy", "lr"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert [m["step"] for m in m2] == [1.0, 2.0]
    assert be1.last_perf["perf/train_tokens_per_s"] > 0 and "perf/mfu" not in be1.last_perf  # CPU


def test_a_few_steps_on_a_fixed_pack_lower_the_loss(first_step) -> None:
    _, be2, *_ , m2 = first_step
    split = make_split(2)
    losses = [m2[0]["loss"]]
    for _ in range(4):
        losses.append(be2.train(split)[0]["loss"])
    assert losses[-1] < losses[0] - 0.01, losses
    assert be2.step == 10
    assert be2.last_timings["handoff_write_s"] < 0.5


def test_published_weights_load_into_an_engine_of_another_process_and_pass_its_check(
        first_step, tiny_chat_path, tiny_chat_model) -> None:
    """The shared-memory transport: rank 0 writes the region, this process (not a
    rank) reads it into its own engine; the fingerprint and the probe hold, and
    a region that is not what was published fails the check."""
    from areno.fleet.weight_sync import reports_fingerprint
    from areno.fleet.weight_sync import SyncCheck, load_region
    from areno.rollout.hf import HFEngine
    from areno.rollout.probe import WeightSyncError

    _, be2, *_ = first_step
    region = be2.publish_weights()
    names = [e.name for e in region.layout.entries]
    assert set(names) == set(tiny_chat_model.state_dict().keys()) | {"lm_head.weight"}
    assert "lm_head.weight" in names and not any(n.startswith(("module.", "_orig_mod.", "hf.")) for n in names)
    full = full_state_dict(be2)
    for n, t in region_tensors(be2._weights[0].buf, region.layout):
        assert torch.equal(t, full[n]), n
    engine = HFEngine(tiny_chat_path, dtype="float32", device="cpu")
    check = SyncCheck(reports_fingerprint(engine), rank=0)
    out = load_region(engine, region, check)
    assert region.probe is not None and out["probe_diff"] <= out["probe_tolerance"]
    with torch.no_grad():
        engine.model.lm_head.weight.mul_(1.01)  # what the engine holds is no longer what was sent
    with pytest.raises(WeightSyncError, match="rank 0"):
        check.check(engine, region.fingerprint, None)


def test_save_pretrained_and_resume_on_another_world_size(first_step, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, be2, *_ = first_step
    model_dir = be2.save_pretrained(tmp_path / "model")
    state_dir = be2.save_state(tmp_path / "state")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "temp dir left behind"
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert_states_close(loaded, {k: v for k, v in full_state_dict(be2).items() if k in loaded}, atol=0)
    AutoTokenizer.from_pretrained(model_dir)
    split2, split1 = make_split(2, seed=7), make_split(1, seed=7)
    want = be2.train(split2)
    with TorchBackend(config(model_dir, 1)) as resumed:  # optimizer state resharded 2 -> 1
        resumed.load_state(state_dir)
        assert resumed.step == be2.step - len(want)
        got = resumed.train(split1)
        assert [m["step"] for m in got] == [m["step"] for m in want]
        for a, b in zip(got, want):
            for k in ("loss", "grad_norm", "lr"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
        assert_states_close(full_state_dict(resumed), full_state_dict(be2))


def test_ddp_strategy_matches_fsdp2(first_step, tiny_chat_path) -> None:
    *_, s2, _, m2 = first_step
    with TorchBackend(config(tiny_chat_path, 2, strategy="ddp")) as be:
        assert be.strategy == "ddp"
        m = be.train(make_split(2))
        assert_states_close(full_state_dict(be), s2)
    assert [x["loss"] for x in m] == pytest.approx([x["loss"] for x in m2], rel=1e-4)


def test_grad_checkpointing_under_fsdp2_makes_the_same_update(first_step, tiny_chat_path) -> None:
    """The checkpointed layers sit inside FSDP2's per-layer units: their recompute
    in backward runs on unsharded weights and the update is bit-equal."""
    *_, s2, _, m2 = first_step
    with TorchBackend(config(tiny_chat_path, 2, grad_checkpointing=True)) as be:
        assert be.strategy == "fsdp2"
        m = be.train(make_split(2))
        state = full_state_dict(be)
    assert state.keys() == s2.keys() and all(torch.equal(state[k], s2[k]) for k in s2)
    assert [x["loss"] for x in m] == [x["loss"] for x in m2]


def test_controller_rejects_token_ids_outside_the_vocabulary(first_step) -> None:
    be1, *_ = first_step
    split = make_split(1)
    split.pack.input_ids[3] = be1.vocab_size + 5
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        be1.train(split)


def test_a_rank_with_no_sequences_still_steps(first_step) -> None:
    """One sequence, two ranks: rank 1 runs a zero-weight dummy micro-batch so the
    collectives line up; the step counts only the real tokens."""
    from areno.split import build_split_pack
    from helpers import random_batch

    _, be2, *_ = first_step
    b = random_batch(seed=5, group_sizes=[1], vocab=300)
    split = build_split_pack(b, np.ones(1, np.float32), world_size=2, max_tokens=64)
    assert split.rank_seq_range(1)[0] == split.rank_seq_range(1)[1]
    (m,) = be2.train(split)
    assert m["num_tokens"] == split.pack.num_tokens and m["num_seqs"] == 1.0 and m["nan_skipped"] == 0.0


def test_torchrun_launch_with_bytes_transport_matches_spawn(first_step, tiny_chat_path, tmp_path) -> None:
    """Ranks started by torchrun dial the controller (launcher='external'); with
    ARENO_RANK_ASSUME_REMOTE they take the multi-node bytes path for packs and weights."""
    import subprocess
    import sys

    from areno.backend.controller import free_port

    *_, s2, _, m2 = first_step
    port = free_port()
    env = dict(os.environ, ARENO_BACKEND_AUTHKEY="ab" * 16, ARENO_RANK_ASSUME_REMOTE="1",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "areno.backend.rank", "--connect", f"127.0.0.1:{port}"]
    log = open(tmp_path / "torchrun.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        os.environ["ARENO_BACKEND_AUTHKEY"] = env["ARENO_BACKEND_AUTHKEY"]
        cfg = config(tiny_chat_path, 2, launcher="external", listen_host="127.0.0.1", listen_port=port,
                     startup_timeout_s=120)
        with TorchBackend(cfg) as be:
            m = be.train(make_split(2))
            assert [x["loss"] for x in m] == pytest.approx([x["loss"] for x in m2], rel=1e-4)
            region = be.publish_weights()  # rank 0 sends the bytes inline: no shared memory with it
            assert_states_close(dict(region_tensors(be._weights[0].buf, region.layout)), s2)
        assert proc.wait(timeout=60) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        os.environ.pop("ARENO_BACKEND_AUTHKEY", None)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
