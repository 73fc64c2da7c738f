"""The signals a job's stop sends to all of it (procs/signals.py, section 4):
the run's other processes hold them, nohup's ignore is kept, and a wait on a
backend that a second interrupt tore down is a BackendError, not a crash. The
process-level runs are tests/test_interrupt_group.py (faults tier)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areno.procs.errors import BackendError
from areno.backend.launch import PeerShape, spawn_peers
from areno.procs.replies import Peers, ReplyStream
from test_faults import REPO


def test_a_rank_ignores_the_jobs_stop_signals_from_its_first_instant_and_the_controller_still_stops_it():
    """A signal that comes while the rank is still starting (its spawn bootstrap,
    before any areno code ran) is held too: it starts with them blocked."""
    early = spawn_peers(PeerShape(world_size=1))
    try:
        pid = early.procs[0].pid
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            os.kill(pid, sig)
        time.sleep(1.0)
        assert early.procs[0].is_alive(), early.procs[0].exitcode
    finally:
        t0 = time.monotonic()
        early.close()
    assert not early.procs[0].is_alive() and time.monotonic() - t0 < 3.0


def test_an_ignore_inherited_for_sighup_is_kept(tmp_path):
    """`nohup areno train`: a logout must not stop the run."""
    code = ("import os, signal, time\n"
            "from areno.procs.signals import held, interrupts_raise\n"
            "with held():\n    pass\n"
            "with interrupts_raise():\n"
            "    os.kill(os.getpid(), signal.SIGHUP)\n"
            "    time.sleep(0.2)\n"
            "print('still running')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN), timeout=60)
    assert res.returncode == 0 and "still running" in res.stdout, res.stderr[-2000:]


def test_waiting_on_a_backend_a_second_interrupt_aborted_is_a_backend_error():
    """Its pipes are gone: the wait used to fail inside the selector
    (ValueError: Invalid file object: None), a traceback instead of the resume line."""
    peers = Peers([None], [], abort=lambda: None, is_closed=lambda: True)
    stream = ReplyStream(peers, "rollout", 0.0, [0], lane="rollout", detach=True, background=True)
    with pytest.raises(BackendError, match="backend is closed"):
        stream.wait(time.monotonic() + 1.0)


def test_ranks_and_engine_processes_are_named_in_ps():
    """`areno: rank i of run PID` / `areno: engine j of run PID` (the command line,
    through setproctitle where installed) and areno-rank{i} / areno-engine{j} (comm)."""
    early = spawn_peers(PeerShape(world_size=1, rollout_world_size=1))
    try:
        want = {early.procs[0].pid: ("areno-rank0", f"areno: rank 0 of run {os.getpid()}"),
                early.engines.procs[0].pid: ("areno-engine0", f"areno: engine 0 of run {os.getpid()}")}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_comm(p) != c for p, (c, _) in want.items()):
            time.sleep(0.05)
        assert {p: _comm(p) for p in want} == {p: c for p, (c, _) in want.items()}
        try:
            import setproctitle  # noqa: F401
        except ImportError:
            return
        assert {p: _cmdline(p) for p in want} == {p: t for p, (_, t) in want.items()}
        for p in want:  # the title did not overwrite the environment (the fault harness reads it)
            assert b"ARENO_TEST_TAG=" in Path(f"/proc/{p}/environ").read_bytes(), p
    finally:
        early.close()


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()
