"""Start-up: the rank processes are spawned before the controller loads its
tokenizer and data, so their imports (torch, transformers, the worker) overlap
the controller's; a user mistake found meanwhile stops them. The time this
saves is scripts/bench_startup.py's to show, not a test's."""

from __future__ import annotations

import psutil

import areno.run
from areno.cli import main


def spawned_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_ranks_start_before_the_data_loads_and_a_data_mistake_stops_them(tmp_path, monkeypatch, capsys,
                                                                          tiny_arith_path):
    seen: list[int] = []
    load_data = areno.run.load_data

    def counting(*args, **kwargs):
        seen.append(len(spawned_children()))
        return load_data(*args, **kwargs)

    monkeypatch.setattr(areno.run, "load_data", counting)
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4,}\n')
    rc = main(["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(bad), "--reward-fn-path",
               "builtin:arith", "--no-chat-template", "--world-size", "2", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "line 2: not valid JSON" in err[0], err
    assert seen == [2]  # both ranks were already running when the data was read
    assert spawned_children() == []  # stopped on the way out (stop_processes joins them)


def test_early_ranks_are_adopted_by_the_backend(tiny_chat_path):
    """TorchBackend(config, early) sends each early peer its config: the ranks say
    hello with the pids spawn_peers started, and train as if spawned there."""
    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.backend.launch import PeerShape, spawn_peers

    early = spawn_peers(PeerShape(2))
    pids = [p.pid for p in early.procs]
    with TorchBackend(BackendConfig(model_path=str(tiny_chat_path), world_size=2), early) as be:
        assert be.rank_pids == pids and early.adopted
    assert not any(p.is_alive() for p in early.procs)


def test_early_peers_of_another_shape_are_refused_and_stopped(tiny_chat_path):
    import pytest

    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.backend.launch import PeerShape, spawn_peers

    early = spawn_peers(PeerShape(1))
    with pytest.raises(ValueError, match="early peers are PeerShape.world_size=1"):
        TorchBackend(BackendConfig(model_path=str(tiny_chat_path), world_size=2), early)
    assert not any(p.is_alive() for p in early.procs)
