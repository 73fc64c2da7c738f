"""Failure paths of TorchBackend: a rank's exception, a SIGKILLed rank and K
non-finite steps in a row each stop the backend within seconds and leave no
process and no shared-memory segment behind. (Own module: no other backend may
be alive while children are counted.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from areno.backend import BackendError, TorchBackend
from arenobench.lib import child_env
from test_backend_procs import assert_clean, config
from test_backend_units import make_split
from helpers import rank_debug

pytestmark = pytest.mark.faults


def test_rank_exception_raises_backend_error_fast_and_cleans_up(tiny_chat_path) -> None:
    be = TorchBackend(config(tiny_chat_path, 2))
    pids = be.rank_pids
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="rank 1 failed: RuntimeError: debug failure") as info:
        rank_debug(be, {0: "barrier", 1: "raise"})  # rank 0 blocks in a collective rank 1 never joins
    assert time.monotonic() - t0 < 10
    assert info.value.rank == 1 and "cmd_debug" in info.value.remote_traceback
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert_clean()
    with pytest.raises(BackendError, match="closed"):
        be.train(make_split(2))


def test_sigkilled_rank_is_noticed_within_seconds_mid_train(tiny_chat_path) -> None:
    be = TorchBackend(config(tiny_chat_path, 2))
    victim = be.rank_pids[1]
    split = make_split(2, num_minibatches=4, max_tokens=16)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(BackendError, match="rank 1 .*killed by SIGKILL|rank 1 closed") as info:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            be.train(split)
    assert time.monotonic() - killed_at[0] < 10, str(info.value)
    assert_clean()


def test_k_nonfinite_steps_in_a_row_stop_the_run(tiny_chat_path) -> None:
    be = TorchBackend(config(tiny_chat_path, 1, max_nan_steps=2))
    out = be.train(make_split(1, num_minibatches=1, nan_adv=True))
    assert out[0]["nan_skipped"] == 1.0
    with pytest.raises(BackendError, match="NonFiniteStepsError: 2 optimizer steps in a row"):
        be.train(make_split(1, num_minibatches=1, nan_adv=True))
    assert_clean()




def test_a_command_past_its_timeout_names_the_command_and_the_option(tiny_chat_path) -> None:
    be = TorchBackend(config(tiny_chat_path, 1, command_timeout_s=2))
    with pytest.raises(BackendError, match=r"debug: rank\(s\) \[0\] did not answer within 2s "
                                           r"\(--command-timeout\)"):
        rank_debug(be, "sleep", seconds=60)
    assert_clean()


def test_ctrl_c_in_the_controller_stops_every_rank(tiny_chat_path) -> None:
    import _thread

    be = TorchBackend(config(tiny_chat_path, 1))
    threading.Timer(1.0, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        rank_debug(be, "sleep", seconds=60)
    assert time.monotonic() - t0 < 10
    assert_clean()


_ORPHAN_SCRIPT = r"""
import os, signal
from areno.backend import BackendConfig, TorchBackend
from helpers import list_segments
from test_backend_units import make_split
if __name__ == "__main__":
    be = TorchBackend(BackendConfig(model_path={model!r}, world_size=1))
    be.train(make_split(1))
    be.publish_weights()
    print(" ".join(map(str, be.rank_pids)), flush=True)
    print(" ".join(list_segments(os.getpid())), flush=True)
    if {how!r} == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without close(); atexit / finalizers must clean up
"""


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_ranks_and_segments_do_not_outlive_the_controller(tiny_chat_path, tmp_path, how) -> None:
    """Controller SIGKILLed (ranks: PDEATHSIG / parent watchdog; segments: the
    resource tracker) or exiting without close() (finalizers)."""
    import subprocess
    import sys

    from areno.procs.segment import SHM_DIR

    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "controller.py"
    script.write_text(_ORPHAN_SCRIPT.format(model=str(tiny_chat_path), how=how))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env=child_env(tests))  # test_backend_units beside this file
    lines = proc.stdout.splitlines()
    assert len(lines) >= 2, proc.stderr[-3000:]
    pids, segments = [int(p) for p in lines[0].split()], lines[1].split()
    assert len(pids) == 1 and len(segments) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        left = [s for s in segments if os.path.exists(os.path.join(SHM_DIR, s))]
        if not alive and not left:
            break
        time.sleep(0.2)
    assert not alive, f"orphaned ranks {alive}"
    assert not left, f"leaked segments {left}"
