"""The timing hooks benchmarks use instead of patching areno: PhaseTimer's spans
(areno/trainer.py) and RankHooks (areno/backend/hooks.py)."""

from __future__ import annotations

import time

import pytest
from test_backend_units import local_worker, make_split

from areno.backend.handoff import PackWriter
from areno.backend.hooks import RANK_HOOKS_ENV, RankHooks, load_rank_hooks
from areno.trainer import PhaseTimer


def test_phase_timer_sub_phases_are_spans_only() -> None:
    timer = PhaseTimer(keep_spans=True)
    t0 = time.monotonic()
    with timer("materialize"):
        with timer.span("advantages"):
            pass
        with timer.span("pack"):
            time.sleep(0.01)
    with timer("materialize"):
        pass
    assert set(timer.times) == {"materialize"} and timer.times["materialize"] >= 0.01
    names = [s[0] for s in timer.spans]
    assert names == ["advantages", "pack", "materialize", "materialize"]  # in order of ending
    for _, start, end, cpu in timer.spans:
        assert t0 <= start <= end <= time.monotonic() and cpu >= 0
    (pack,) = [s for s in timer.spans if s[0] == "pack"]
    outer = timer.spans[2]
    assert outer[1] <= pack[1] and pack[2] <= outer[2]  # nested on the same clock


def test_phase_timer_keeps_no_spans_by_default() -> None:
    timer = PhaseTimer()
    with timer("decode"), timer.span("inner"):
        pass
    assert timer.spans is None and set(timer.times) == {"decode"}


class LastMicroHooks(RankHooks):
    """Records the calls; trains only the last micro-batch of each mini-batch."""

    calls: list[str] = []

    def train_begin(self, rank: int) -> None:
        self.calls.append(f"begin{rank}")

    def before_update(self, micros):
        self.calls.append(f"update{[len(row) for row in micros]}")
        self.kept_tokens = [row[-1].num_tokens for row in micros]
        return [row[-1:] for row in micros]

    def train_end(self, rank: int, local, reply: dict) -> None:
        self.calls.append(f"end{len(reply['steps'])}")


class NotHooks:
    pass


def test_rank_hooks_named_by_the_env_see_every_train_command(tiny_chat_path, monkeypatch) -> None:
    monkeypatch.setenv(RANK_HOOKS_ENV, f"{__name__}:LastMicroHooks")
    LastMicroHooks.calls = []
    split = make_split(1, num_minibatches=2, max_tokens=48)
    with local_worker(tiny_chat_path, monkeypatch, lr=1e-3) as worker:
        assert isinstance(worker.hooks, LastMicroHooks)
        writer = PackWriter()
        try:
            (h,) = writer.write(split)
            steps = worker.cmd_train(h)["steps"]
        finally:
            writer.close()
    m = int(split.plan.micro_seqs.shape[2])
    assert m > 1, "the split should have several micro-batches per mini-batch"
    assert LastMicroHooks.calls == ["begin0", f"update{[m, m]}", "end2"]
    assert [s["num_tokens"] for s in steps] == worker.hooks.kept_tokens  # only the kept subset trained


def test_rank_hooks_default_and_bad_names(monkeypatch) -> None:
    monkeypatch.delenv(RANK_HOOKS_ENV, raising=False)
    assert type(load_rank_hooks()) is RankHooks
    monkeypatch.setenv(RANK_HOOKS_ENV, "no_colon")
    with pytest.raises(ValueError, match="module:attr"):
        load_rank_hooks()
    monkeypatch.setenv(RANK_HOOKS_ENV, f"{__name__}:NotHooks")
    with pytest.raises(TypeError, match="not a RankHooks"):
        load_rank_hooks()


class StubEngine:
    max_model_len = 32

    def shutdown(self) -> None:
        pass


class EngineHooks(RankHooks):
    seen: list = []

    def make_engine(self, cfg, device):
        EngineHooks.seen.append((cfg.count, str(device)))
        return StubEngine(), "stub"


def test_an_engine_process_builds_the_engine_its_hooks_make(tiny_chat_path, monkeypatch) -> None:
    """RankHooks.make_engine: None (the base) leaves the engine to cfg.engine; a
    benchmark's hooks return their own (scripts/arenobench/longcot/ranks.py), consulted
    before anything is built, and the hello reports its kind."""
    from test_split_placement import backend_config

    from areno.fleet.engine_proc import EngineWorker

    assert RankHooks().make_engine(None, None) is None
    monkeypatch.setenv(RANK_HOOKS_ENV, f"{__name__}:EngineHooks")
    monkeypatch.setenv("ARENO_ENGINE_INDEX", "0")
    import torch

    EngineHooks.seen = []
    threads = torch.get_num_threads()  # EngineWorker sets the process's (its own, in an engine process)
    worker = EngineWorker(backend_config(tiny_chat_path, 1).engine_procs())
    try:
        assert isinstance(worker.engine, StubEngine) and EngineHooks.seen == [(1, "cpu")]
        hello = worker.hello()
        assert hello["engine"] == "stub" and hello["engine_max_model_len"] == 32 and not hello["fingerprinted"]
    finally:
        worker.close()
        torch.set_num_threads(threads)
