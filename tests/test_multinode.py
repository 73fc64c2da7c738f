"""Multi-node from the CLI, tested as 2 nodes on localhost: the same update as
one node with 2 ranks; user mistakes in the multi-node flags are one line."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from areno.backend.launch import free_port

STEPS = ["--max-steps", "2", "--no-save", "--rollout-engine", "hf"]


def _train(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "areno.cli", "train", *STEPS, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))


def _metrics(run_dir) -> np.ndarray:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return np.array([[r["reward/mean"], r["train/loss"], r["train/grad_norm"]] for r in rows])


@pytest.mark.slow  # a minute of end-to-end run on 2 busy cores; its parts are tested in the default tier
def test_two_nodes_on_localhost_give_the_one_node_update(tmp_path):
    env = {"ARENO_BACKEND_AUTHKEY": secrets.token_hex(16)}
    port = str(free_port())
    multi = ["--nnodes", "2", "--master-port", port]
    worker = _train([*multi, "--node-rank", "1"], env)
    head = _train([*multi, "--node-rank", "0", "--output-dir", str(tmp_path / "multi")], env)
    _, err = head.communicate(timeout=600)
    assert head.returncode == 0, err[-3000:]
    _, werr = worker.communicate(timeout=60)
    assert worker.returncode == 0, werr[-3000:]
    assert "node 1 of 2" in werr
    one = _train(["--world-size", "2", "--output-dir", str(tmp_path / "one")], {})
    _, err = one.communicate(timeout=600)
    assert one.returncode == 0, err[-3000:]
    a, b = _metrics(tmp_path / "multi"), _metrics(tmp_path / "one")
    assert a.shape == (2, 3)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, env, needle", [
    (["--nnodes", "2"], {"ARENO_BACKEND_AUTHKEY": ""}, "ARENO_BACKEND_AUTHKEY"),
    (["--nnodes", "2", "--node-rank", "2"], {}, "--node-rank"),
    (["--nnodes", "2", "--nproc-per-node", "1", "--world-size", "4"],
     {"ARENO_BACKEND_AUTHKEY": "ab" * 16}, "--world-size"),
])
def test_multinode_flag_mistakes_are_one_line(args, env, needle, capsys):
    from areno.cli import main

    old = dict(os.environ)
    os.environ.update(env)
    try:
        code = main(["train", *args])
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("areno: error:") and needle in err[0], err


def _connect_when_listening(port: int):
    """A raw TCP connection to the controller, once it listens (10 s at most)."""
    import socket
    import time

    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_bad_connection_is_rejected_and_the_controller_keeps_accepting_ranks(capsys, monkeypatch):
    """A port scan (opened and closed), a peer that sends junk, and one with a wrong
    key are each rejected with their address; the two ranks that dial next (the
    ranks' own dial and hello, areno/backend/rank.py) are adopted."""
    import socket
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from areno.backend.config import BackendConfig
    from areno.procs.segment import ShmSegment
    from areno.backend.launch import accept_ranks
    from areno.backend.rank import _dial

    key = secrets.token_hex(16)
    monkeypatch.setenv("ARENO_BACKEND_AUTHKEY", key)
    port = free_port()
    cfg = BackendConfig(model_path="m", world_size=2, launcher="external", listen_host="127.0.0.1",
                        listen_port=port, startup_timeout_s=30)
    conns: list = [None, None]
    marker = ShmSegment("marker")
    controller = threading.Thread(target=accept_ranks, args=(cfg, conns, marker))
    controller.start()
    try:
        for junk in (b"", b"GET / HTTP/1.0\r\n\r\n"):
            s = _connect_when_listening(port)
            s.sendall(junk)
            s.close()
        with pytest.raises((AuthenticationError, EOFError, OSError)):
            Client(("127.0.0.1", port), authkey=b"wrong key")
        got: dict[int, tuple] = {}

        def rank(r: int) -> None:
            conn = _dial("127.0.0.1", port, bytes.fromhex(key), timeout_s=30)
            conn.send(("hello", r, 2, socket.gethostname()))
            got[r] = conn.recv()
            conn.close()

        ranks = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in ranks:
            t.start()
        for t in ranks + [controller]:
            t.join(60)
        assert not controller.is_alive() and all(c is not None for c in conns), conns
        assert sorted(got) == [0, 1] and all(cfg_sent.world_size == 2 for cfg_sent, _ in got.values())
    finally:
        marker.unlink()
        for c in conns:
            if c is not None:
                c.close()
    rejected = [line for line in capsys.readouterr().err.splitlines() if "rejected a connection from" in line]
    assert len(rejected) == 3 and all("127.0.0.1:" in line for line in rejected), rejected
