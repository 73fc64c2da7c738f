"""Start-up: the rank processes are spawned before the controller loads its
tokenizer and data, so their imports (torch, transformers, the worker) overlap
the controller's; a user mistake found meanwhile stops them. The time this
saves is scripts/bench_startup.py's to show, not a test's."""

from __future__ import annotations

import psutil

import areno.run
from faults import is_peer
from areno.cli import main


def spawned_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if is_peer(" ".join(p.cmdline()))]


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


def test_the_cli_spawns_cpu_ranks_before_it_imports_torch() -> None:
    """`areno train` on CPU: the options checked, the ranks start (runtime/early.py)
    before this process has imported torch or transformers."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from areno.cli.app import run_app\n"
            "from areno.config.train import TrainConfig\n"
            "from areno.config.resume import resume_config\n"
            "from areno.runtime.early import prespawn\n"
            "cfg = resume_config(TrainConfig.from_sources(None, {'device': 'cpu', 'world_size': 2}), set())\n"
            "early = prespawn(cfg)\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print(len(early.procs), heavy, early.shape.device)\n"
            "early.close()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[0] == "2 [] cpu", res.stdout


def test_the_ranks_the_cli_spawned_are_the_ones_that_train(tmp_path, areno_cache, tiny_arith_path) -> None:
    """One spawn: the peer that imported early is the one that serves the run, its
    output reaches the run's run.log, and its temporary log is gone."""
    import os
    import subprocess
    import sys

    from areno.timing import STARTUP_TRACE_ENV

    trace, out = tmp_path / "trace", tmp_path / "run"
    env = {**os.environ, STARTUP_TRACE_ENV: str(trace), "TMPDIR": str(tmp_path), "ARENO_CACHE": str(areno_cache)}
    res = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--max-steps", "1",  # the demo
                          "--batch-size", "2", "--n-samples", "2", "--no-save", "--output-dir", str(out)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    marks = [line.split(maxsplit=2)[1:] for line in trace.read_text().splitlines()]
    controller = marks[0][0]
    order = [label for pid, label in marks if pid == controller]
    assert order == ["main", "peers spawned", "run dir ready", "tokenizer loaded", "backend ready"], marks
    peers = {pid for pid, label in marks if label == "peer imports"}
    assert len(peers) == 1 and [pid for pid, label in marks if label == "peer ready"] == list(peers), marks
    assert not list(tmp_path.glob("areno-early-*")), "the temporary log was left behind"


def test_an_early_childs_output_moves_into_the_run_log(tmp_path) -> None:
    """What a peer printed before the run dir existed (its temporary log), and all
    it prints after, from Python and from C, is in run.log; nothing on the terminal."""
    import subprocess
    import sys

    early, run_log = tmp_path / "areno-early-x.log", tmp_path / "run.log"
    code = ("import os, sys\n"
            "from areno.rundir.log import ENV, move_child_output, redirect_child_output\n"
            f"os.environ[ENV] = {str(early)!r}\n"
            "redirect_child_output()\n"
            "print('before', flush=True); os.write(2, b'c-level before\\n')\n"
            f"move_child_output({str(run_log)!r})\n"
            "print('after', flush=True); os.write(2, b'c-level after\\n')\n"
            "assert os.environ[ENV] == %r\n" % str(run_log))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == res.stderr == "", (res.stdout, res.stderr)
    assert run_log.read_text().splitlines() == ["before", "c-level before", "after", "c-level after"]
    assert not early.exists()


def test_the_cpu_host_is_known_without_torch(monkeypatch, tmp_path) -> None:
    from areno.config.train import TrainConfig
    from areno.runtime import early

    def cfg(device: str) -> TrainConfig:
        return TrainConfig.from_sources(None, {"device": device})

    monkeypatch.setattr(early, "GPU_DRIVER_PATHS", (str(tmp_path / "absent"),))
    assert early.certainly_cpu(cfg("auto")) and early.certainly_cpu(cfg("cpu"))
    assert not early.certainly_cpu(cfg("cuda"))
    monkeypatch.setattr(early, "GPU_DRIVER_PATHS", (str(tmp_path),))  # a driver: torch decides (run.py)
    assert not early.certainly_cpu(cfg("auto")) and early.certainly_cpu(cfg("cpu"))


def test_a_plain_tokenizer_loads_by_name_and_equals_autotokenizers(tiny_chat_path) -> None:
    """tokenizer_class PreTrainedTokenizerFast (the tiny models'): loaded without
    transformers' auto machinery (seconds of imports), the same tokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from areno.data.tokenizer import load_tokenizer, tokenizer_class

    path = str(tiny_chat_path)
    assert tokenizer_class(path) == "PreTrainedTokenizerFast" and tokenizer_class("org/model") is None
    plain, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "12+30="}]
    assert type(plain) is type(auto)
    assert plain.apply_chat_template(chat, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, add_generation_prompt=True)
    assert plain("12+30=42 ok")["input_ids"] == auto("12+30=42 ok")["input_ids"]
    assert (plain.eos_token_id, plain.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    code = (f"import sys\nfrom areno.run import load_tokenizer\nload_tokenizer({path!r})\n"
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "False", res.stderr
