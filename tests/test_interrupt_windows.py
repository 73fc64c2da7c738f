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

from areno.procs.signals import interrupts_raise
from helpers import rank_debug


class SignalsAt:
    """A rank's Connection that signals this process once (SIGINT by default), inside send (before the
    bytes go) or inside recv (after the final "ok" is read): where a real signal
    can land, since Python runs handlers between any two bytecodes."""

    def __init__(self, conn: Any, where: str, sig: int = signal.SIGINT) -> None:
        self._conn, self._where, self._sig, self.fired = conn, where, sig, False

    def __getattr__(self, name: str) -> Any:  # fileno, poll, ... for wait()
        return getattr(self._conn, name)

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            os.kill(os.getpid(), self._sig)

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
    from areno.backend.rank_engines import RankEngines
    from areno.rollout.engine import SamplingConfig
    from areno.rollout.factory import EngineSpec

    cfg = BackendConfig(model_path=str(tiny_arith_path), world_size=1,
                        engine=EngineSpec(kind="hf", max_model_len=64))
    # SIGHUP too (a closed terminal): the pipe hold once left it out (issue 25).
    windows = [(w, s) for s in (signal.SIGINT, signal.SIGHUP) for w in ("send", "recv")]
    with TorchBackend(cfg) as be, interrupts_raise():
        for where, sig in windows:  # one backend for every window: start-up is the slow part
            conn = be._conns[0]
            be._conns[0] = spy = SignalsAt(conn, where, sig)
            with pytest.raises(KeyboardInterrupt):
                RankEngines(be).generate(np.array([5, 12, 3, 13], np.int32), np.array([0, 2, 4]), 2,
                                         SamplingConfig(max_tokens=3, seed=1))
            be._conns[0] = conn
            what = f"{signal.Signals(sig).name} in {where}"
            assert spy.fired, what
            path = be.save_pretrained(tmp_path / f"{where}_{sig}")  # what interrupted() does next
            assert (path / "config.json").is_file() and (path / "model.safetensors").is_file(), what
        rank_debug(be, "noop")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_every_run_signal_waits_for_the_pipe_message_it_lands_in(sig):
    """Sent from inside the held block (where a real one lands between two bytecodes
    of a pipe write): the rest of the block runs, then the run's handler raises."""
    from areno.procs.signals import signals_held

    done = []
    with interrupts_raise(), pytest.raises(KeyboardInterrupt):
        with signals_held():
            os.kill(os.getpid(), sig)
            done.append("the rest of the message")
    assert done == ["the rest of the message"], signal.Signals(sig).name


def test_the_step_window_defers_from_its_update_to_its_end_and_an_error_ends_it():
    """train_loop's one deferral block: a signal after update_starts() waits for the
    block's end; an exception inside ends the deferral, so the next signal raises."""
    from areno.procs.signals import step_window

    done = []
    with interrupts_raise():
        with pytest.raises(KeyboardInterrupt):
            with step_window() as update_starts:
                update_starts()
                os.kill(os.getpid(), signal.SIGHUP)  # marked: the step goes on
                done.append("logged and saved")
        assert done == ["logged and saved"]
        with pytest.raises(ValueError):
            with step_window() as update_starts:
                update_starts()
                raise ValueError("a backend failure, say")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # not deferred any more: raises at once
            done.append("not reached")
    assert done == ["logged and saved"]


def test_an_interrupt_inside_a_periodic_save_waits_for_it(tmp_path, monkeypatch, capsys):
    """The stress script's finding: a Ctrl-C inside --save-interval's save aborted
    the save and the backend with it, so neither that save nor the interrupt's
    could be written ('step 3 could not be saved')."""
    from types import SimpleNamespace

    import areno.trainer
    from areno.procs.errors import BackendError
    def step(run, n, update_starts):  # the real one calls it as its update starts
        update_starts()
        return {"sampling/reward_generated": 0.0}

    def save(n: int) -> None:
        if backend.closed:
            raise BackendError("backend is closed")
        try:
            if not backend.fired:
                backend.fired = True
                os.kill(os.getpid(), signal.SIGINT)  # in the middle of the ranks' writes
            (tmp_path / "checkpoints" / f"step_{n:06d}").mkdir(parents=True)
            (tmp_path / "checkpoints" / f"step_{n:06d}" / "trainer_state.json").write_text("{}")
        except KeyboardInterrupt:
            backend.closed = True  # what an interrupted backend command does
            raise

    backend = SimpleNamespace(step=0, dead=None, closed=False, fired=False)
    sampler = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None)
    logger = SimpleNamespace(log=lambda *a, **k: None, info=print)
    run = SimpleNamespace(cfg=SimpleNamespace(no_save=False, save_interval=1, eval_interval=0, save_path=None,
                                              stop_at_reward=None),
                          recent_rewards=[], output_dir=tmp_path, step=0, total_steps=3, backend=backend, dead=None,
                          sampler=sampler,
                          logger=logger, save=save,
                          rollouts=SimpleNamespace(taken=[], put_back=lambda: None,
                                                   settle_interrupt=lambda after_step: None))
    monkeypatch.setattr(areno.trainer, "train_step", step)
    with interrupts_raise(), pytest.raises(SystemExit) as e:
        areno.trainer.train_loop(run)
    assert e.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("areno: interrupted (SIGINT) after step 1 of 3; checkpoint "), err
    assert err.endswith(f"--resume {tmp_path / 'checkpoints' / 'step_000001'}")


# A SIGINT sent to itself right after main()'s hold starts: where a user's Ctrl-C
# lands during the start-up imports (torch, numpy, transformers take seconds).
SIGINT_IN_HOLD = """
import contextlib, os, signal, sys
import areno.procs.signals as ss
hold = ss.held
@contextlib.contextmanager
def held_then_sigint():
    with hold():
        os.kill(os.getpid(), signal.SIGINT)
        yield
ss.held = held_then_sigint  # before areno.cli imports it
from areno.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv, says", [
    (["train", "--max-steps", "1", "--no-save"], "areno: interrupted (SIGINT) during start-up: nothing was written"),
    (["plot", "."], "areno: interrupted"),
])
def test_a_ctrl_c_during_the_start_up_imports_waits_for_the_command_to_handle_it(argv, says, tmp_path, areno_cache):
    """Held, not raised inside an import (a half-initialised torch or numpy made the
    next import fail with a traceback, or CPython exit -2 after areno's message):
    `train` stops with its start-up line, `plot` with `areno: interrupted`; 130."""
    import subprocess
    import sys

    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", SIGINT_IN_HOLD, *argv, *(["--output-dir", str(out)]
                          if argv[0] == "train" else [])], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ARENO_CACHE": str(areno_cache)}, cwd=tmp_path)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and res.stderr.startswith(says), res.stderr
    assert not out.exists()


def test_the_hold_gives_back_the_handlers_it_found():
    from areno.procs import signals
    before = signal.getsignal(signal.SIGINT)
    with signals.held():
        os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised
        assert signals.take() == ["SIGINT"]
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_once_the_run_said_its_last_line_a_later_signal_is_only_recorded(sig, monkeypatch):
    """run_ending (interrupted, stopped): a signal 10 ms after a Ctrl-C used to land
    in the close that follows the line and report the interrupt a second time
    (test_interrupt_group's two interrupts). Now it is recorded, and the block's
    end gives back the handlers it found."""
    from areno.procs import signals
    from areno.procs.signals import last_signal, run_ending

    monkeypatch.setattr(signals, "_received", [])  # what this test sends stays here
    before = signal.getsignal(sig)
    run_ending()  # outside the run's handlers: nothing changes
    assert signal.getsignal(sig) is before
    with interrupts_raise():
        run_ending()
        os.kill(os.getpid(), sig)  # the handler runs before the next bytecode: nothing raises
        assert last_signal() == sig.name
    assert signal.getsignal(sig) is before


def test_an_interrupt_python_drops_in_a_finalizer_is_raised_at_the_next_check(monkeypatch, capfd):
    """CI's start-up Ctrl-C landed in an import's module-lock weakref callback:
    Python printed "Exception ignored in ... SignalInterrupt" and the run trained on.
    Now the drop is silent and marked, and raise_dropped (start-up's end, each
    step) raises it; another exception a finalizer drops still reaches the hook."""
    import sys

    from areno.procs import signals
    from areno.procs.signals import raise_dropped

    monkeypatch.setattr(signals, "_received", [])
    seen = []
    hook = lambda u: seen.append(u.exc_type)  # noqa: E731
    monkeypatch.setattr(sys, "unraisablehook", hook)

    class Finalized:
        def __init__(self, fail: Any) -> None:
            self.fail = fail

        def __del__(self) -> None:
            self.fail()

    with interrupts_raise():
        Finalized(lambda: os.kill(os.getpid(), signal.SIGINT))  # the handler raises inside __del__
        with pytest.raises(KeyboardInterrupt):
            raise_dropped()
        raise_dropped()  # once only
        Finalized(lambda: 1 / 0)
    assert seen == [ZeroDivisionError] and sys.unraisablehook is hook
    assert "Traceback" not in capfd.readouterr().err
