"""Rollout engines inside the ranks: prompt placement, generation on every rank,
overlap identity through the ranks, the weight-sync probe in fp32 and bf16, and
a controller that never imports vLLM nor touches CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from areno.procs.errors import BackendError
from areno.backend.launch import free_port
from areno.fleet.engines import assign_groups
from areno.rollout.probe import PROBE_ROUNDING_UNITS, probe_tolerance
from helpers import rank_debug

TESTS = Path(__file__).parent


def test_assign_groups_is_lpt_balanced_and_deterministic():
    rng = np.random.default_rng(0)
    cost = rng.integers(10, 1000, 57)
    a = assign_groups(cost, 4)
    assert a.shape == (57,) and set(a.tolist()) == {0, 1, 2, 3}
    np.testing.assert_array_equal(a, assign_groups(cost, 4))
    loads = np.bincount(a, weights=cost, minlength=4)
    # LPT: no engine exceeds the mean by more than the largest single prompt
    assert loads.max() - loads.mean() <= cost.max()
    assert loads.max() / loads.min() < 1.1
    np.testing.assert_array_equal(assign_groups(cost, 1), np.zeros(57))
    # fewer prompts than engines: some engines get none
    assert sorted(assign_groups(np.array([5, 3]), 4).tolist()) == [0, 1]


def _scenarios(model: Path, kind: str, dtype: str, *which: str) -> dict:
    res = subprocess.run([sys.executable, str(TESTS / "probe_scenarios.py"), str(model), kind, dtype,
                          str(free_port()), *which], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# The full tier adds vLLM in fp32; by default each engine runs bf16, the GPU's dtype.
@pytest.mark.parametrize("dtype,kind", [("float32", "hf"), ("bfloat16", "hf"), ("bfloat16", "vllm"),
                                        pytest.param("float32", "vllm", marks=pytest.mark.slow)])
def test_a_correct_sync_passes_and_corrupted_stale_or_partial_ones_fail(tiny_scaled_path, kind, dtype):
    """On a model with real-model logit scale (25), where a fixed bf16 tolerance
    of 1e-2 failed correct syncs: the probe's derived bound passes them, and the
    exact checks fail every bad one (the fingerprint, naming the group; a load
    that misses a name, in transformers). Without vLLM's fingerprint its bf16
    corrupted and stale syncs passed the probe (0.17 and 0.63 < 1.8)."""
    if kind == "vllm":
        pytest.importorskip("vllm")
    out = _scenarios(tiny_scaled_path, kind, dtype)
    assert out["correct"] == "ok" and out["correct_again"] == "ok", out
    assert "rank 0" in out["corrupted"] and "(model.layers.1.self_attn: sum of squares" in out["corrupted"], out
    assert "rank 0" in out["stale"] and "not the trainer's" in out["stale"], out
    # transformers refuses a load that misses a name; vLLM takes it (the fused
    # qkv_proj keeps uninitialized k rows), and its fingerprint sees it
    partial = "weight update is missing 1 tensors" if kind == "hf" else "(model.layers.1.self_attn: sum of squares"
    assert out["partial"].startswith("WeightSyncError") and partial in out["partial"], out
    first, second, third = out["probes"]
    assert first["probe_scale"] > 20, first  # the real-model scale the bound is derived from
    assert first["probe_tolerance"] == PROBE_ROUNDING_UNITS * first["probe_unit"], first
    assert first["probe_diff"] <= first["probe_tolerance"], first
    # the fingerprint checks every sync; the probe (numerics) calibrates at the
    # first and holds the 50th to the calibrated tolerance
    assert second == {}, out
    assert out["calibrated"] == "ok", out
    assert third["probe_tolerance"] == probe_tolerance(third["probe_unit"], first["probe_diff"]), out
    assert third["probe_tolerance"] <= first["probe_tolerance"], out  # calibration only tightens


@pytest.mark.parametrize("kind", ["hf", "vllm"])
@pytest.mark.realmodel
def test_a_correct_bf16_sync_of_the_real_model_passes(smol_path, kind):
    """SmolLM2-135M in bf16, the issue's failure (0.266 against a fixed 0.01):
    the fingerprint matches exactly and the probe's diff is within its bound."""
    if kind == "vllm":
        pytest.importorskip("vllm")
    out = _scenarios(smol_path, kind, "bfloat16", "correct")
    assert out["correct"] == "ok", out
    (probe,) = out["probes"]
    assert probe["probe_scale"] > 10 and probe["probe_diff"] <= probe["probe_tolerance"], probe


# vLLM's twin is the full tier's: the rest of this file holds vLLM in the ranks by default
@pytest.mark.parametrize("kind", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_two_ranks_both_generate_and_overlap_equals_plain(tiny_arith_path, tmp_path, kind):
    if kind == "vllm":
        pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.rollout.factory import EngineSpec
    from areno.backend.rank_engines import RankEngines
    from test_overlap import check_engine

    cfg = BackendConfig(model_path=str(tiny_arith_path), world_size=2,
                        engine=EngineSpec(kind=kind, max_model_len=64, kv_cache_bytes=64 << 20))
    with TorchBackend(cfg) as be:
        engines = RankEngines(be)
        assert engines.kinds == [kind] and engines.num_engines == 2
        # the start line's note: the release and model runner vLLM built (rollout.factory)
        assert engines.notes == ([f"vLLM {__import__('vllm').__version__}, V1 model runner"]
                                 if kind == "vllm" else [])
        check_engine(engines, AutoTokenizer.from_pretrained(tiny_arith_path), tmp_path)
        assert len(engines.last_tokens) == 2 and min(engines.last_tokens) > 0
        be.sync_weights()  # the probe holds on every rank


CPU_ONLY_RUN = """
import sys, torch
from areno.config.train import TrainConfig
from areno.run import open_run
from areno.procs.signals import interrupts_raise
from areno.trainer import train_loop
cfg = TrainConfig.from_sources(overrides=dict(max_steps=2, world_size=2, output_dir=sys.argv[1],
                                              no_save=True, rollout_engine="vllm"))
with interrupts_raise(), open_run(cfg) as run:  # run_training's Run and loop, the ranks' engines in view
    kinds = run.engine.kinds  # what the ranks built (their hellos)
    train_loop(run)
print("vllm" in sys.modules, torch.cuda.is_initialized(), *kinds)
"""


def test_controller_imports_no_vllm_and_holds_no_cuda_context(tmp_path):
    """A real 2-rank CPU run of the demo with vLLM engines in the ranks (asked for
    by name, so a vLLM that does not import fails the run instead of falling
    back to transformers, which would leave nothing for the controller to avoid)."""
    res = subprocess.run([sys.executable, "-c", CPU_ONLY_RUN, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    # the controller: no vllm, no CUDA; the ranks: vLLM engines, as asked
    assert res.stdout.strip().splitlines()[-1] == "False False vllm", res.stdout[-2000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


@pytest.mark.alone
def test_an_interrupt_during_a_draining_command_leaves_the_backend_usable(tiny_chat_path):
    """Ctrl-C in a rollout or weight sync waits (briefly) for the ranks to finish, so
    the last finished step can still be saved; elsewhere it aborts the backend."""
    import signal
    import threading
    import time

    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend

    def interrupt_soon() -> None:
        threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()

    with TorchBackend(BackendConfig(model_path=str(tiny_chat_path), world_size=1)) as be:
        stream = be.peers.broadcast("debug", range(be.world_size), drain_s=5.0, action="sleep", seconds=1.5)
        interrupt_soon()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            stream.gather(30)
        assert time.monotonic() - t0 < 5
        rank_debug(be, "noop")  # still usable: the sleep's reply was drained
        stream = be.peers.broadcast("debug", range(be.world_size), action="sleep", seconds=1.5)
        interrupt_soon()
        with pytest.raises(KeyboardInterrupt):
            stream.gather(30)
        with pytest.raises(BackendError):
            rank_debug(be, "noop")


def _rollouts(run, background: bool, updates: int, saved=()):
    """The run's scheduler over a producer that only says where its engines are."""
    from types import SimpleNamespace

    from areno.scheduler import Rollouts

    run.rows = run.prompts = None
    return Rollouts(run, SimpleNamespace(background=background), updates, list(saved))


def test_an_interrupted_step_counts_only_if_its_update_was_applied():
    """Colocated: the step's round was taken; undone, its prompts go back."""
    from types import SimpleNamespace

    from areno.data.sampler import PromptSampler
    from areno.scheduler import Inflight
    from areno.trainer import settle_interrupted_step

    for landed in (False, True):
        sampler = PromptSampler(55, 16, seed=0)
        state = sampler.state_dict()
        first = sampler.next_batch()
        run = SimpleNamespace(step=4, sampler=sampler, backend=SimpleNamespace(step=4 + landed),
                              cfg=SimpleNamespace(off_policy_steps=0), total_steps=10)
        run.rollouts = _rollouts(run, False, 4)
        run.rollouts.taken = [Inflight(5, first, state, 4)]
        settle_interrupted_step(run, (5, 4))
        assert run.step == 4 + landed
        if landed:
            assert not np.array_equal(sampler.next_batch(), first)
        else:
            np.testing.assert_array_equal(sampler.next_batch(), first)  # the prompts go back


class _Running:
    """A Pending stand-in that never gets whole (the engine still generating)."""

    def __init__(self) -> None:
        self.dropped = False

    def wait(self, until: float) -> bool:
        return False

    def drop(self) -> None:
        self.dropped = True


def test_an_interrupt_keeps_the_whole_rollouts_in_flight_and_puts_the_prompts_of_the_others_back():
    """Engine processes drew steps 6 and 7's prompts during step 5; 6 is whole,
    7 still generating. Whether or not step 5's update landed, the checkpoint
    keeps what is whole from step run.step + 1 on (5's own round back in
    flight when its update did not land) and its sampler stands before 7's prompts."""
    from types import SimpleNamespace

    from areno.data.sampler import PromptSampler
    from areno.scheduler import Inflight
    from areno.trainer import settle_interrupted_step

    for landed in (False, True):
        sampler = PromptSampler(55, 16, seed=0)
        drawn = []
        for step in (5, 6, 7):
            before = sampler.state_dict()
            drawn.append(Inflight(step, sampler.next_batch(), before, version=4))
        batch7 = drawn[2].prompt_idx
        drawn[2].pending = _Running()
        run = SimpleNamespace(step=4, sampler=sampler, backend=SimpleNamespace(step=4 + landed),
                              cfg=SimpleNamespace(off_policy_steps=2), total_steps=10)
        run.rollouts = rollouts = _rollouts(run, True, 4, drawn[1:])
        rollouts.taken = [drawn[0]]  # taken by step 5
        settle_interrupted_step(run, (5, 4))
        assert run.step == 4 + landed
        assert [c.step for c in rollouts.inflight] == ([6] if landed else [5, 6])
        assert drawn[2].pending.dropped
        np.testing.assert_array_equal(sampler.next_batch(), batch7)  # 7's prompts come back


def test_a_rollout_left_suspended_is_settled_before_the_next_command(tiny_arith_path, tmp_path):
    """An exception while a part is scored keeps the rollout's generator alive (in
    the traceback) while the interrupt handler saves: the save must not take the
    rollout's late replies for its own."""
    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.backend.rank_engines import RankEngines
    from areno.rollout.engine import SamplingConfig
    from areno.rollout.factory import EngineSpec

    cfg = BackendConfig(model_path=str(tiny_arith_path), world_size=1,
                        engine=EngineSpec(kind="hf", max_model_len=64))
    with TorchBackend(cfg) as be:
        stream = RankEngines(be).generate_stream(np.array([5, 12, 3, 13], np.int32),
                                                 np.array([0, 2, 4]), 2, SamplingConfig(max_tokens=3, seed=1))
        next(stream)  # a part taken; the engine's final reply not yet read
        path = be.save_pretrained(tmp_path / "model")
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        rank_debug(be, "noop")
        del stream


def test_an_interrupt_between_a_rollouts_sends_and_its_first_read_is_drained(tiny_arith_path, tmp_path,
                                                                              monkeypatch):
    """The reply stream is open before the sends: an interrupt before the first
    read (here: raised as the read starts) leaves replies that the next command
    must not take for its own (the clean-clone failure of the SIGINT test)."""
    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.backend.rank_engines import RankEngines
    from areno.procs.replies import ReplyStream
    from areno.rollout.engine import SamplingConfig
    from areno.rollout.factory import EngineSpec

    cfg = BackendConfig(model_path=str(tiny_arith_path), world_size=1,
                        engine=EngineSpec(kind="hf", max_model_len=64))
    with TorchBackend(cfg) as be:
        def interrupted(*a, **k):
            raise KeyboardInterrupt
            yield  # a generator, as ReplyStream.events is

        monkeypatch.setattr(ReplyStream, "events", interrupted)
        with pytest.raises(KeyboardInterrupt):
            list(RankEngines(be).generate_stream(np.array([5, 12, 3, 13], np.int32), np.array([0, 2, 4]), 2,
                                                 SamplingConfig(max_tokens=3, seed=1)))
        monkeypatch.undo()
        path = be.save_pretrained(tmp_path / "model")  # the rollout's replies are drained first
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        rank_debug(be, "noop")
