"""Ctrl-C at the exact windows where it could split a pipe message (issue 17,
the rare 'step N could not be saved' of the SIGINT test): in the middle of a
rollout's send, and between reading a rank's final reply and counting it. Each
interrupt must stop the rollout, and the next command (the interrupt's save)
must still find the backend usable."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest

from areno.interrupt import interrupts_raise
from helpers import rank_debug


class SignalsAt:
    """A rank's Connection that SIGINTs this process once, inside send (before the
    bytes go) or inside recv (after the final "ok" is read): where a real signal
    can land, since Python runs handlers between any two bytecodes."""

    def __init__(self, conn: Any, where: str) -> None:
        self._conn, self._where, self.fired = conn, where, False

    def __getattr__(self, name: str) -> Any:  # fileno, poll, ... for wait()
        return getattr(self._conn, name)

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            os.kill(os.getpid(), signal.SIGINT)

    def send(self, obj: Any) -> None:
        if self._where == "send" and obj[0] == "generate":
            self._fire()
        self._conn.send(obj)

    def recv(self) -> Any:
        msg = self._conn.recv()
        if self._where == "recv" and msg[0] == "ok":
            self._fire()
        return msg


def test_an_interrupt_inside_a_rollouts_send_or_read_leaves_the_backend_usable(tiny_arith_path, tmp_path):
    from areno.backend.config import BackendConfig
    from areno.backend.controller import TorchBackend
    from areno.backend.rollout import RankEngines
    from areno.rollout.engine import SamplingConfig
    from areno.rollout.factory import EngineSpec

    cfg = BackendConfig(model_path=str(tiny_arith_path), world_size=1,
                        engine=EngineSpec(kind="hf", max_model_len=64))
    with TorchBackend(cfg) as be, interrupts_raise():
        for where in ("send", "recv"):  # one backend for both windows: start-up is the slow part
            conn = be._conns[0]
            be._conns[0] = spy = SignalsAt(conn, where)
            with pytest.raises(KeyboardInterrupt):
                RankEngines(be).generate(np.array([5, 12, 3, 13], np.int32), np.array([0, 2, 4]), 2,
                                         SamplingConfig(max_tokens=3, seed=1))
            be._conns[0] = conn
            assert spy.fired, where
            path = be.save_pretrained(tmp_path / where)  # what interrupted() does next
            assert (path / "config.json").is_file() and (path / "model.safetensors").is_file(), where
        rank_debug(be, "noop")
