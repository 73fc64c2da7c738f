"""What an interrupt does to the run: stop within seconds, keep the last
finished step.

The signals themselves (Ctrl-C, SIGTERM, SIGHUP, and when they raise) are
areno/procs/signals.py's. Once one has stopped the loop, the last finished
step is saved through the still-running backend, one line gives the exact
`--resume` command, and areno exits 130. Once a step's update has started, the
first interrupt waits for the step to end (train, weight sync, log, and its save
when one is due: then it is saved whole); during a rollout the ranks are drained
(backend/controller.py). A second interrupt, or one inside the interrupt's own
save, aborts the backend, and the newest existing checkpoint is named instead.

The backend's watchdog also SIGINTs the main thread when a rank dies; the
caller tells that apart by `run.dead` before calling `interrupted`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from areno.procs.errors import BackendError
from areno.rundir.checkpoint import checkpoint_root, latest_checkpoint
from areno.procs.signals import last_signal, run_ending
from areno.rundir.runconfig import RUN_CONFIG
from areno.errors import UserError
from areno.rundir.reporting import limit_note

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def interrupted(run: Any) -> None:
    """Save run.step (the last finished step) unless a checkpoint of it exists,
    print where the run stopped and how to continue, exit 130."""
    name = last_signal()
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
    run_ending()
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
    name = last_signal()
    out = _startup["run_dir"]
    if out is None and cfg.output_dir and (Path(cfg.output_dir) / RUN_CONFIG).is_file():
        out = Path(cfg.output_dir)  # the interrupt came as make_output_dir returned
    if out is None:
        wrote = "nothing was written yet"
    else:
        files = ", ".join(f for f in (RUN_CONFIG, "run.log") if (out / f).is_file())
        ckpt = "" if cfg.resume else ", no checkpoint (no step ran)"
        wrote = f"run dir {out} has {files or 'nothing'}{ckpt}"
    if cfg.resume:
        again = f"{cfg.resume} is untouched; resume again with the same command"
    else:
        again = "start again with the same command"
    run_ending()
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
