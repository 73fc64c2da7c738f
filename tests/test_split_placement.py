"""Split placement (--rollout-world-size M): M engine processes beside the N
ranks sample the prompts, get the trained weights through the shared-memory
transport and pass the same check as a rank's own engine; the watchdog covers
them; a short demo run learns."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import numpy as np
import pytest

from helpers import rank_debug
from test_backend_units import make_split
from inprocess import run_here
from test_resume import SMALL, ok

PROMPTS = (np.array([5, 12, 3, 13, 7, 9], np.int32), np.array([0, 2, 4, 6]))


def backend_config(path, m: int, **kw):
    from areno.backend.config import BackendConfig
    from areno.rollout.factory import EngineSpec

    return BackendConfig(model_path=str(path), world_size=1, engine=EngineSpec(kind="hf", max_model_len=64),
                         rollout_world_size=m, **kw)


@contextlib.contextmanager
def split_placement(cfg):
    """(the backend of cfg's ranks, its engine processes, the loop's view of them),
    the two started apart as a run starts them (run.py)."""
    from areno.backend.controller import TorchBackend
    from areno.fleet.engine_procs import EngineProcs
    from areno.fleet.engines import ProcEngines

    with TorchBackend(cfg) as be, EngineProcs(cfg.engine_procs()) as fleet:
        yield be, fleet, ProcEngines(fleet, be)


def test_engine_processes_sample_and_load_each_trained_version_checked(tiny_chat_path):
    from areno.backend.controller import TorchBackend
    from areno.backend.rank_engines import RankEngines
    from areno.rollout.engine import SamplingConfig

    sampling = SamplingConfig(max_tokens=4, seed=3)
    with TorchBackend(backend_config(tiny_chat_path, 0)) as be:
        colocated = RankEngines(be).generate(*PROMPTS, 2, sampling)
    with split_placement(backend_config(tiny_chat_path, 1)) as (be, fleet, engines):
        # The backend drives its rank only; the engine process is the fleet's.
        assert be.hellos[0]["engine"] is None and fleet.hellos[0]["engine"] == "hf"
        assert len(be.peers.conns) == 1 and engines.num_engines == 1 and engines.groups == [[0]]
        before = engines.generate(*PROMPTS, 2, sampling)
        # Same weights, same seeds, same engine code: the same samples as colocated.
        np.testing.assert_array_equal(before.response_ids, colocated.response_ids)
        syncs = []
        for _ in range(2):
            be.train(make_split(1))
            syncs.append(engines.sync_weights())
        assert be.publishes == 2 and all(t["sync_load_s"] > 0 for t in syncs)
        # Every load compares the sender's fingerprint (load_region raises on a
        # mismatch); the first also runs the probe, the second skips it (probe_due).
        assert fleet.fingerprinted
        assert syncs[0]["probe_diff"] <= syncs[0]["probe_tolerance"]
        assert "probe_diff" not in syncs[1]
        after = engines.generate(*PROMPTS, 2, sampling)
        assert not np.array_equal(after.response_logprobs, before.response_logprobs)  # new weights serve
        rank_debug(be, "noop")  # the ranks still answer after the engine commands


def test_a_corrupted_region_fails_the_engine_process_check(tiny_chat_path):
    """A sync after the first carries no probe (probe_due): the exact fingerprint
    alone must catch one flipped bit, on every load."""
    from areno.procs.errors import BackendError

    with split_placement(backend_config(tiny_chat_path, 1)) as (be, fleet, engines):
        be.train(make_split(1))
        engines.sync_weights()  # the first sync: fingerprint and probe
        be.train(make_split(1))
        region = be.publish_weights()
        assert region.probe is None and region.fingerprint is not None
        entry = next(e for e in region.layout.entries if ".layers." in e.name)
        be._weights[0].buf[entry.offset + 2] ^= 0x40  # one mantissa bit of one weight of a layer
        with pytest.raises(BackendError, match="engine process 0 failed: WeightSyncError"):
            fleet.load(region)


def lora_backend_config(path, kind: str = "hf", **kw):
    """One rank, one engine process serving the rank's LoRA adapter (max_lora_rank 8)."""
    from areno.backend.config import BackendConfig, LoraSpec
    from areno.rollout.factory import EngineSpec

    return BackendConfig(model_path=str(path), world_size=1, lr=1e-2, rollout_world_size=1,
                         engine=EngineSpec(kind=kind, fallback=False, max_model_len=64, kv_cache_bytes=16 << 20,
                                           max_lora_rank=8),
                         lora=LoraSpec(rank=8, alpha=16.0), **kw)


@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_under_lora_engine_processes_load_each_trained_adapter_checked(tiny_chat_path, kind):
    """Only the adapter travels: the region holds peft's A/B tensors, and the engine
    process serves each trained version, its adapter fingerprint equal to rank 0's
    (load_region raises on a mismatch), the first load also probed."""
    from areno.rollout.engine import SamplingConfig

    if kind == "vllm":
        pytest.importorskip("vllm")
    sampling = SamplingConfig(max_tokens=4, seed=3)
    with split_placement(lora_backend_config(tiny_chat_path, kind)) as (be, fleet, engines):
        assert fleet.hellos[0]["engine"] == kind
        before = engines.generate(*PROMPTS, 2, sampling)
        syncs, regions = [], []
        for _ in range(2):
            be.train(make_split(1))
            regions.append(be.publish_weights(fingerprinted=fleet.fingerprinted))
            syncs.append(fleet.load(regions[-1]))
        names = [e.name for e in regions[0].layout.entries]
        assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
        assert [r.version for r in regions] == [1, 2] and regions[0].adapter.r == 8
        trainable = be.hellos[0]["trainable_params"]  # the adapter's values, fp32: 64-byte aligned slots
        assert trainable * 4 <= regions[0].layout.nbytes < trainable * 4 + 64 * len(names)
        assert trainable < be.hellos[0]["params"] / 2
        # Both loads compared rank 0's adapter fingerprint; the first also ran the probe.
        assert fleet.fingerprinted and set(regions[0].fingerprint.sums) == \
            set(regions[1].fingerprint.sums)
        assert syncs[0]["probe_diff"] <= syncs[0]["probe_tolerance"] and "probe_diff" not in syncs[1]
        after = engines.generate(*PROMPTS, 2, sampling)
        assert not np.array_equal(after.response_logprobs, before.response_logprobs)  # the adapter serves
        rank_debug(be, "noop")


def test_a_corrupted_adapter_region_fails_the_engine_process_check(tiny_chat_path):
    """As for full weights: a load with no probe due is held to rank 0's exact
    adapter fingerprint, which one flipped bit of one B value breaks."""
    from areno.procs.errors import BackendError

    with split_placement(lora_backend_config(tiny_chat_path)) as (be, fleet, engines):
        be.train(make_split(1))
        engines.sync_weights()  # the first sync: fingerprint and probe
        be.train(make_split(1))
        region = be.publish_weights()
        assert region.probe is None and region.adapter is not None
        entry = next(e for e in region.layout.entries if e.name.endswith(".lora_B.weight"))
        be._weights[0].buf[entry.offset + 2] ^= 0x40  # one mantissa bit of one trained B value
        with pytest.raises(BackendError, match="WeightSyncError"):
            fleet.load(region)


@pytest.mark.timing
def test_a_dead_engine_process_stops_the_run_within_seconds(tiny_chat_path):
    """Between commands: the engine processes' own watchdog interrupts the main thread."""
    with split_placement(backend_config(tiny_chat_path, 1, shutdown_grace_s=2.0)) as (be, fleet, engines):
        killed = time.monotonic()
        os.kill(fleet.pids[0], signal.SIGKILL)
        with pytest.raises(KeyboardInterrupt):  # the watchdog interrupts the main thread
            time.sleep(30)
        assert time.monotonic() - killed < 5
        assert fleet.dead is not None and "engine process 0" in str(fleet.dead) and "died" in str(fleet.dead)
        assert be.dead is None


@pytest.mark.timing
def test_a_stopped_engine_process_stops_the_run_at_its_heartbeat_bound(tiny_chat_path):
    """SIGSTOP: no death to see, only a silence. The engine processes' heartbeats are
    watched by their own watchdog: past the bound it kills the stopped process
    and interrupts the main thread, naming it."""
    cfg = backend_config(tiny_chat_path, 1, heartbeat_timeout_s=2.0, shutdown_grace_s=2.0)
    with split_placement(cfg) as (be, fleet, engines):
        pid = fleet.pids[0]
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(KeyboardInterrupt):
                time.sleep(30)
        finally:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        assert time.monotonic() - stopped < 8
        assert "engine process 0" in str(fleet.dead) and "no heartbeat" in str(fleet.dead)


@pytest.mark.timing
def test_an_engine_process_dying_while_the_ranks_train_stops_the_train_call(tiny_chat_path):
    """The ranks' waits read the engines' pipes and sentinels too (Peers.neighbours):
    an engine process killed during a rollout in flight is reported by the wait
    the controller is in (a train command), with its own name."""
    from areno.procs.errors import BackendError
    from areno.rollout.engine import SamplingConfig

    with split_placement(backend_config(tiny_chat_path, 1, shutdown_grace_s=2.0)) as (be, fleet, engines):
        pending = engines.start_rollout(*PROMPTS, 2, SamplingConfig(max_tokens=4, seed=3), None)
        pending.wait(time.monotonic() + 60)  # the engine is up and has answered once
        pending.collect()
        rank_debug(be, "noop")
        engines.start_rollout(*PROMPTS, 2, SamplingConfig(max_tokens=64, seed=3), None)
        os.kill(fleet.pids[0], signal.SIGKILL)
        with pytest.raises(BackendError, match="engine process 0 .*died"):
            rank_debug(be, "sleep", seconds=5.0)


@pytest.mark.learning
def test_demo_with_an_engine_process_follows_the_colocated_learning_curve(tmp_path, areno_cache):
    """Seeded, K = 0: the same run with its engine in a process of its own (weights
    through the shared-memory transport) gives the colocated run's metrics step
    for step: same samples, same rewards, same losses. Bit-identical, not close:
    the same engine code on the same bytes with the same per-engine seeds and
    thread count. A sync that left the engine behind diverges at step 2."""
    def run(name: str, extra: list[str]) -> list[dict]:
        out = tmp_path / name
        ok(run_here(["train", *SMALL, "--rollout-engine", "hf", "--world-size", "1", "--max-steps", "6",
                     "--seed", "0", "--no-save", "--output-dir", str(out), *extra], areno_cache))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k.startswith(("reward/", "train/loss", "response/"))} for r in rows]

    colocated, split = run("colocated", []), run("split", ["--rollout-world-size", "1"])
    assert len(split) == 6 and all("train/loss" in r for r in split)
    assert split == colocated


def test_engine_processes_need_one_node_and_an_engine(monkeypatch):
    from areno.backend.config import BackendConfig
    from areno.config.train import TrainConfig
    from areno.errors import UserError
    from areno.runtime.placement import check_placement

    monkeypatch.setenv("ARENO_BACKEND_AUTHKEY", "0" * 32)
    with pytest.raises(UserError, match=r"--rollout-world-size 1: .*--nnodes 1"):
        check_placement(TrainConfig.from_sources(overrides=dict(rollout_world_size=1, nnodes=2)), 1, 2, "cpu")
    with pytest.raises(ValueError, match="rollout_world_size.*only with an engine"):
        BackendConfig(model_path="m", rollout_world_size=1)
