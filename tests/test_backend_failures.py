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
from test_backend_procs import assert_clean, config
from test_backend_units import make_split

pytestmark = pytest.mark.slow


def test_rank_exception_raises_backend_error_fast_and_cleans_up(tiny_chat_path) -> None:
    be = TorchBackend(config(tiny_chat_path, 2))
    pids = be.rank_pids
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="rank 1 failed: RuntimeError: debug failure") as info:
        be.debug({0: "barrier", 1: "raise"})  # rank 0 blocks in a collective rank 1 never joins
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


