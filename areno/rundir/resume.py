"""Where a run starts: the checkpoint --resume names, found, checked and put back
in start-up order (Resume), or a fresh run in a directory that may hold an
earlier one that never saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areno.errors import UserError
from areno.rundir.checkpoint import (check_checkpoint, checkpoint_root, drop_after, latest_checkpoint,
                                     remove_stale, restore_controller_rng, run_roots)


class Resume:
    """Where a run starts: the checkpoint --resume names (`ckpt`, with its trainer
    state), or none, a fresh run. open_run uses it in start-up order: `find` before
    anything starts; `validate` once the run directory is known, before anything is
    written there; `restore_sampler` with the data, before any process starts (a
    changed dataset is a user error); `restore_backend` once the ranks are up;
    `restore_rng` last. For a fresh run the restores do nothing."""

    def __init__(self, ckpt: Path | None = None, state: dict | None = None) -> None:
        self.ckpt = ckpt
        self.state = state or {}

    @classmethod
    def find(cls, cfg: Any) -> "Resume":
        """The checkpoint --resume names, read (a fresh run without --resume).
        UserError unless it is a complete checkpoint."""
        if cfg.resume is None:
            return cls()
        if cfg.resume != "latest":
            ckpt = Path(cfg.resume).expanduser()
            return cls(ckpt, check_checkpoint(ckpt))
        if not cfg.save_path and not cfg.output_dir:
            raise UserError("--resume latest needs --output-dir (or --save-path) to look in")
        roots = run_roots(cfg, Path(cfg.output_dir or "."))
        ckpt = next(filter(None, map(latest_checkpoint, roots)), None)
        if ckpt is None:
            raise UserError(f"--resume latest: no complete checkpoint under "
                            f"{' or '.join(map(str, roots))} (a run that stopped before its first "
                            "checkpoint starts again without --resume)")
        return cls(ckpt, check_checkpoint(ckpt))

    @property
    def step(self) -> int:
        """The last step the checkpoint holds (0: a fresh run)."""
        return int(self.state["step"]) if self.ckpt else 0

    @property
    def base_model(self) -> str | None:
        """The model the resumed run started from (its reference model); None when fresh."""
        return self.state["model_path"] if self.ckpt else None

    def validate(self, cfg: Any, out: Path) -> None:
        """Fit the run directory `out` to this start. Resumed: checkpoints after this
        one belong to the abandoned continuation (like its metrics.jsonl lines), so they
        go: `--resume latest` must not pick them later. Fresh: a run already in `out`
        starts again if it never saved (UserError if it did); an eval-only run leaves
        it alone."""
        if self.ckpt is not None:
            drop_after(checkpoint_root(cfg, out), self.step)
        elif not cfg.eval_only and (out / "metrics.jsonl").is_file():
            _restart_unsaved(cfg, out)

    def restore_sampler(self, sampler: Any) -> None:
        """Continue the data order where the checkpoint left it."""
        if self.ckpt is not None and sampler is not None:
            sampler.load_state_dict(self.state["sampler"])

    def restore_backend(self, backend: Any) -> None:
        """Optimizer, LR scheduler and RNG states of every rank."""
        if self.ckpt is not None:
            backend.load_state(self.ckpt / "backend")

    def restore_rng(self) -> None:
        """The controller's RNGs: last, as engine and backend start-up may reseed them."""
        if self.ckpt is not None:
            restore_controller_rng(self.ckpt)


def _restart_unsaved(cfg: Any, out: Path) -> None:
    """`out` holds a run (metrics.jsonl) and no --resume was given: start it again
    from step 0 if it never wrote a checkpoint, wherever it saved (there is nothing
    to resume), else UserError pointing at --resume latest. Its metrics are kept,
    renamed (metrics.1.jsonl, ...)."""
    roots = run_roots(cfg, out)
    saved = next(filter(None, map(latest_checkpoint, roots)), None)
    if saved is not None:
        raise UserError(f"--output-dir {out} already holds a run with checkpoint {saved}: "
                        "continue it with --resume latest, or choose another --output-dir")
    kept = keep_old_metrics(out)
    for root in roots:  # half-written checkpoints
        if root.is_dir():
            remove_stale(root)
    print(f"areno: {out} holds a run that stopped before its first checkpoint (its metrics "
          f"kept as {kept.name}): starting it again from step 0", flush=True)


def keep_old_metrics(out: Path) -> Path:
    """Rename out/metrics.jsonl to the first free metrics.N.jsonl; returns the new path."""
    n = 1
    while (out / f"metrics.{n}.jsonl").exists():
        n += 1
    dest = out / f"metrics.{n}.jsonl"
    (out / "metrics.jsonl").rename(dest)
    return dest
