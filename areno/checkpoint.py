"""Checkpoints: HF-format model + tokenizer (loadable by vLLM and transformers as
they are) and the trainer state for an exact resume.

A checkpoint is written into a hidden temporary directory beside its final
place and renamed into place only when complete, so only complete checkpoints
are ever visible: a crash mid-save leaves a `.tmp-*` directory that is never
picked up (and is removed by the next save).

    <save_path>/step_000100/
        config.json, model.safetensors, tokenizer files   (HF format)
        trainer_state.json   step, data cursor, run config
        backend/             optimizer, LR scheduler, RNG states of every rank
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from areno.backend.controller import BackendError
from areno.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_root(cfg: Any, output_dir: Path) -> Path:
    return Path(cfg.save_path).expanduser() if cfg.save_path else output_dir / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def save_checkpoint(run: Any, step: int) -> Path:
    """Write run's state at `step` atomically; prune to --keep-last. Returns the path."""
    root = checkpoint_root(run.cfg, run.output_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        run.backend.save_pretrained(tmp)  # HF model files at the top level (creates tmp)
        run.backend.save_state(tmp / "backend")  # optimizer, scheduler, RNG of every rank
        run.tokenizer.save_pretrained(str(tmp))
        state = {
            "step": step,
            "sampler": run.sampler.state_dict(),
            "model_path": run.model_path,
            "config": run.cfg.to_dict(),
        }
        _write_json(tmp / STATE_FILE, state)
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step replaces it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except (OSError, BackendError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())[:300]
        raise UserError(f"cannot save checkpoint {final}: {why} "
                        "(the previous checkpoint is intact)") from None
    prune(root, run.cfg.keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--resume {ckpt}: not a complete areno checkpoint ({e})") from None


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
