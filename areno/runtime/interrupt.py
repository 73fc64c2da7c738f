"""Ctrl-C, SIGTERM and SIGHUP: stop within seconds, keep the last finished step.

Both signals raise KeyboardInterrupt in the main thread (SIGTERM normally kills
the process without a word). The training loop then saves the last finished
step through the still-running backend, prints one line with the exact
`--resume` command, and exits 130. Once a step's update has started, the first
interrupt waits for the step to end (train, weight sync, log, and its save when
one is due: then it is saved whole); during a rollout the ranks are drained
(backend/controller.py). A second interrupt, or one inside the interrupt's own
save, aborts the backend, and the newest existing checkpoint is named instead.

The backend's watchdog also SIGINTs the main thread when a rank dies; the
caller tells that apart by `backend.dead` before calling `interrupted`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from areno.backend.errors import BackendError
from areno.rundir.checkpoint import checkpoint_root, latest_checkpoint
from areno.runtime import startsignals
from areno.errors import SignalInterrupt, UserError
from areno.rundir.reporting import limit_note

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
_received: list[str] = []  # names of the signals seen, newest last


_deferred: dict[str, Any] = {"on": False, "hit": False}


def _raise(signum: int, frame: Any) -> None:
    _received.append(signal.Signals(signum).name)
    if _deferred["on"] and not _deferred["hit"]:  # a second one raises at once
        _deferred["hit"] = True
        return
    raise SignalInterrupt


def defer_interrupts() -> None:
    """From here until release_interrupts(), the first Ctrl-C/SIGTERM only marks
    the step: once its update has reached the weights, finishing it (sync, log)
    is the only way to save it as a whole."""
    _deferred.update(on=True, hit=False)


def release_interrupts(*, raise_pending: bool = True) -> None:
    """End the deferral; raise KeyboardInterrupt if an interrupt came meanwhile."""
    hit = _deferred["hit"]
    _deferred.update(on=False, hit=False)
    if hit and raise_pending:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) raise
    KeyboardInterrupt while the block runs (only the main thread may set
    handlers: elsewhere, a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in startsignals.HELD}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def raise_held() -> None:
    """Raise the interrupt that came while start-up held the signals (see
    startsignals), if one did; from here on they are this module's."""
    came = startsignals.take()
    if came:
        _received.extend(came)
        raise SignalInterrupt


def stdout_closed() -> None:
    """stdout's reader went away (`areno train | head -3`): stop as a closed
    pipe stops any Unix command, but as an interrupt (save the last finished
    step, the resume line on stderr). Later writes go to /dev/null, so the
    shutdown's own output cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    _received.append("SIGPIPE")
    raise SignalInterrupt


def interrupted(run: Any) -> None:
    """Save run.step (the last finished step) unless a checkpoint of it exists,
    print where the run stopped and how to continue, exit 130."""
    name = _received[-1] if _received else "SIGINT"
    root = checkpoint_root(run.cfg, run.output_dir)
    last = latest_checkpoint(root)
    note = "; --no-save: nothing saved" if run.cfg.no_save else ""
    if run.step > 0 and not run.cfg.no_save and (last is None or last.name != _step_dir(run.step)):
        try:
            run.save(run.step)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, the save is atomic
            note = f"; saving step {run.step} was interrupted"
        except (BackendError, UserError):
            # The interrupt came inside a backend command, which aborts the backend.
            note = f"; step {run.step} could not be saved (the backend had stopped)"
    ckpt = latest_checkpoint(root)
    cut = _limit_note(run)
    where = (f"interrupted ({name}) after step {run.step} of {run.total_steps}"
             + (f" ({cut})" if cut else "") + note)
    if ckpt is None:
        how = ("no checkpoint yet; start again with the same command: "
               f"{resume_command(None)}")
    else:
        how = f"checkpoint {ckpt}; continue with: {resume_command(ckpt)}"
    print(f"areno: {where}; {how}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)


_startup: dict[str, Path | None] = {"run_dir": None}  # set once the run directory exists


def made_run_dir(path: Path | None) -> None:
    """Start-up has written the run directory (config.yaml, run.log): an interrupt
    before the first step names it (None: a new start-up, nothing written yet)."""
    _startup["run_dir"] = None if path is None else Path(path)


def interrupted_at_startup(cfg: Any) -> None:
    """An interrupt before the first step: say what was written (the run dir and
    its config.yaml, or nothing), that no checkpoint was, how to start again; exit 130."""
    name = _received[-1] if _received else "SIGINT"
    out = _startup["run_dir"]
    if out is None and cfg.output_dir and (Path(cfg.output_dir) / "config.yaml").is_file():
        out = Path(cfg.output_dir)  # the interrupt came as make_output_dir returned
    if out is None:
        wrote = "nothing was written yet"
    else:
        files = ", ".join(f for f in ("config.yaml", "run.log") if (out / f).is_file())
        ckpt = "" if cfg.resume else ", no checkpoint (no step ran)"
        wrote = f"run dir {out} has {files or 'nothing'}{ckpt}"
    if cfg.resume:
        again = f"{cfg.resume} is untouched; resume again with the same command"
    else:
        again = "start again with the same command"
    print(f"areno: interrupted ({name}) during start-up: {wrote}; {again}: "
          f"{shlex.join(['areno', *sys.argv[1:]])}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)


def _limit_note(run: Any) -> str:
    """Why the run ends short of --max-steps (the resumed command ends there too)."""
    cfg, prompts = run.cfg, getattr(run, "prompts", None)
    if prompts is None:
        return ""
    return limit_note(run.total_steps, cfg.max_steps, cfg.epochs, len(prompts), cfg.batch_size)


def _step_dir(step: int) -> str:
    return f"step_{step:06d}"


def resume_command(ckpt: Path | None, argv: list[str] | None = None) -> str:
    """`areno train ...` as it was started, with `--resume CKPT` in place of any
    --resume it had (none when ckpt is None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--resume":
            skip = True
        elif not a.startswith("--resume="):
            out.append(a)
    if ckpt is not None:
        out += ["--resume", str(Path(ckpt).absolute())]
    return shlex.join(["areno", *out])
