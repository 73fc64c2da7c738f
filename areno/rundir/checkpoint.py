"""Checkpoints: HF-format model + tokenizer (loadable by vLLM and transformers as
they are) and the trainer state for an exact resume.

A checkpoint is written into a hidden temporary directory beside its final
place and renamed into place only when complete, so only complete checkpoints
are ever visible: a crash mid-save leaves a `.tmp-*` directory that is never
picked up (and is removed by the next save).

    <save_path>/step_000100/
        config.json, model.safetensors, tokenizer files   (HF format)
        trainer_state.json   step, data cursor, run config
        controller_rng.pt    the controller's python/numpy/torch RNG states
        backend/             optimizer, LR scheduler, RNG states of every rank

With --lora-rank the model files are the adapter in peft's format instead
(adapter_config.json, adapter_model.safetensors; the base model is the run's
--ckpt, recorded as model_path and as the adapter's base_model_name_or_path),
the optimizer state is the adapters' only, and --save-merged adds merged/, the
merged model in HF format.

`save_checkpoint` writes one; `rundir.resume.Resume` finds the one --resume
names and puts its state back (which options may change on resume is
config/resume.py's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from areno.procs.errors import BackendError
from areno.procs.signals import signals_held
from areno.errors import UserError
from areno.fileperms import OLD_PREFIX, honour_umask, replace_dir
from areno.models.directory import check_model_dir
from areno.rundir.rng import rng_state, set_rng_state
from areno.rundir.runconfig import read_run_config

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
TMP_PREFIX = ".tmp-"  # a save in progress (or interrupted): never listed
CONTROLLER_RNG = "controller_rng.pt"


def checkpoint_root(cfg: Any, output_dir: Path) -> Path:
    return Path(cfg.save_path).expanduser() if cfg.save_path else output_dir / "checkpoints"


def recorded_save_path(output_dir: Path) -> str | None:
    """The --save-path the run in `output_dir` recorded in its config.yaml (None: the
    default place, or no readable config.yaml)."""
    saved = read_run_config(output_dir)
    value = saved.get("save_path") if saved else None
    return value if isinstance(value, str) and value else None


def run_roots(cfg: Any, output_dir: Path) -> list[Path]:
    """Where the run in `output_dir` may have saved: this invocation's save path, then
    the one its config.yaml records (when --save-path is not given now)."""
    roots = [checkpoint_root(cfg, output_dir)]
    recorded = None if cfg.save_path else recorded_save_path(output_dir)
    if recorded is not None:
        roots.append(Path(recorded).expanduser())
    return roots


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


class CheckpointBackend(Protocol):
    def save_pretrained(self, path: Path) -> Any: ...
    def save_state(self, path: Path) -> Any: ...


class Checkpointed(Protocol):
    """What a checkpoint is written from (run.Run is one): the options (cfg:
    save_path, keep_last, to_dict), the run directory, the ranks' backend, the
    tokenizer, the data cursor (sampler.state_dict), the base model's path, and
    the rollout scheduler's state (`rollouts`: its rounds in flight, optional)."""

    cfg: Any
    output_dir: Path
    backend: CheckpointBackend
    tokenizer: Any
    sampler: Any
    model_path: str


def save_checkpoint(run: Checkpointed, step: int) -> Path:
    """Write run's state at `step` atomically; prune to --keep-last. Returns the path.
    The scheduler's rounds in flight are waited for and saved with it
    (scheduler.py; an interrupt drops those it cannot wait for first)."""
    root = checkpoint_root(run.cfg, run.output_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_PREFIX}step_{step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale(root)
        run.backend.save_pretrained(tmp)  # HF model files at the top level (creates tmp)
        run.backend.save_state(tmp / "backend")  # optimizer, scheduler, RNG of every rank
        if not (tmp / "tokenizer_config.json").is_file():
            # The backend copies a local source's tokenizer files verbatim (transformers 5
            # would rewrite tokenizer_class, which older transformers cannot load).
            run.tokenizer.save_pretrained(str(tmp))
        save_controller_rng(tmp / CONTROLLER_RNG)
        rollouts = getattr(run, "rollouts", None)  # the scheduler: its rounds in flight
        ahead = rollouts if rollouts is not None and rollouts.producer.background else None
        state = {
            "step": step,
            "sampler": ahead.checkpoint_state(tmp) if ahead else run.sampler.state_dict(),
            # How many rounds in flight it holds: a resume refuses the checkpoint
            # when their files (scheduler.py) are missing or cut short.
            **({"weight_version": ahead.updates, "inflight": len(ahead.inflight)} if ahead else {}),
            "model_path": run.model_path,
            "recent_rewards": list(getattr(run, "recent_rewards", [])),  # --stop-at-reward's window
            "config": run.cfg.to_dict(),
        }
        _write_json(tmp / STATE_FILE, state)
        honour_umask(tmp)  # transformers writes model.safetensors 0600
        _fsync_dir(tmp)
        replace_dir(tmp, final)
        _fsync_dir(root)
    except (OSError, BackendError) as e:
        full = disk_full_note(root, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, BackendError) and not full and not _ERRNO.search(str(e)):
            # A rank died or froze mid-save: a runtime failure (exit 1, the loop names the
            # checkpoint to resume from), not the user's disk or permissions (exit 2).
            raise BackendError(f"cannot save checkpoint {final}: {e.remote_message}", rank=e.rank,
                               remote_traceback=e.remote_traceback) from None
        last = latest_checkpoint(root)
        kept = f"the previous checkpoint {last} is intact" if last else "no checkpoint was saved"
        raise UserError(f"cannot save checkpoint {final}: {full + ': ' if full else ''}"
                        f"{_save_failure(e)} ({kept})") from None
    prune(root, run.cfg.keep_last)
    return final


def disk_full_note(root: Path, tmp: Path) -> str | None:
    """Say so when a failed save looks like a full disk: less than 16 MiB free, or
    less than another checkpoint as big as the last one needs. (torch.save's zip
    writer reports ENOSPC as "unexpected pos", with no errno to go by.)"""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    last = latest_checkpoint(root)
    need = dir_bytes(last) if last else 0
    if free >= LOW_SPACE and free + dir_bytes(tmp) >= need:
        return None
    return (f"no space left on the device of {root} ({free / 2**20:.1f} MiB free"
            + (f"; a checkpoint takes {need / 2**20:.1f} MiB" if need else "") + ")")


def dir_bytes(path: Path) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def _save_failure(e: BaseException) -> str:
    """The cause on one line: the OS error (ENOSPC, EACCES, ...) when there is one,
    even inside a rank's error, else the rank's message and its exception's last
    line (torch.distributed.checkpoint nests a whole traceback in its message)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    m = _ERRNO.search(str(e))
    rank = getattr(e, "rank", None)
    if m:
        return m.group(1).strip() + (f" (on rank {rank})" if rank is not None else "")
    if isinstance(e, BackendError):
        head = e.remote_message.strip().splitlines()[0]
        tail = [ln for ln in (e.remote_traceback or "").splitlines() if ln.strip()]
        return " ".join(f"{head}{' ... ' + tail[-1].strip() if tail else ''}".split())[:400]
    return " ".join(str(e).split())[:400]


_ERRNO = re.compile(r"\[Errno \d+\] ([^\n'\"():]+)")
LOW_SPACE = 16 << 20  # bytes
# A checkpoint against its weights: AdamW's two moments, in the parameters' dtype, beside
# them, plus the optimizer's metadata and the RNG files (3.17x the tiny demo model's).
CHECKPOINT_PER_WEIGHT_BYTE = 3.3


def checkpoint_bytes(params: int | None, disk_bytes: int, dtype_bytes: int) -> int:
    """Estimated size of one checkpoint of a model of `params` elements trained in a
    dtype of `dtype_bytes` (params unknown: its weight files' `disk_bytes`)."""
    weights = params * dtype_bytes if params is not None else disk_bytes
    return int(weights * CHECKPOINT_PER_WEIGHT_BYTE)


def check_free_space(root: Path, need: int, flag: str) -> None:
    """UserError unless the file system of `root` has room for `need` bytes (one checkpoint)."""
    free = shutil.disk_usage(root).free
    if free < need:
        raise UserError(f"{flag} {root}: {free / 2**20:.1f} MiB free, but one checkpoint of this "
                        f"model needs about {need / 2**20:.1f} MiB (weights and optimizer state); "
                        f"free some space, choose another {flag}, or pass --no-save")


def remove_stale(root: Path) -> None:
    """Delete what an interrupted save left behind: our `.tmp-step_*` dirs, the
    backend's own temp dirs beside them (`..tmp-step_*`, a SIGKILL inside
    save_pretrained), and `.old-step_*` (a SIGKILL between the two renames)."""
    for pattern in (f"{TMP_PREFIX}step_*", f".{TMP_PREFIX}step_*", f"{OLD_PREFIX}step_*"):
        for stale in root.glob(pattern):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest keep_last checkpoints. Each leaves the listing in
    one rename before its files go: a SIGKILL mid-removal leaves an `.old-` dir
    (remove_stale's), never a checkpoint that lists as complete and is not; an
    interrupt waits for the removal (signals held), so none is left behind."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(root)[:-keep_last]:
        gone = old.with_name(f"{OLD_PREFIX}{old.name}-{os.getpid()}")
        with signals_held():
            try:
                os.rename(old, gone)
            except OSError:
                continue  # already gone (another process pruned it)
            shutil.rmtree(gone, ignore_errors=True)


def save_controller_rng(path: Path) -> None:
    """The controller's global RNGs (python, numpy, torch). The loop itself draws
    from none of them (data order is seeded per epoch, sampling per step), but an
    in-process reward plugin (--reward-workers 0) may."""
    with open(path, "wb") as f:
        torch.save(rng_state(), f)
        f.flush()
        os.fsync(f.fileno())


def restore_controller_rng(ckpt: Path) -> None:
    """Put back what save_controller_rng wrote (a no-op for older checkpoints)."""
    path = ckpt / CONTROLLER_RNG
    if path.is_file():
        set_rng_state(torch.load(path, weights_only=False))


def drop_after(root: Path, step: int) -> None:
    """Remove complete checkpoints newer than `step` (a resume abandons them)."""
    for ckpt in list_checkpoints(root):
        m = STEP_DIR.match(ckpt.name)
        if m and int(m.group(1)) > step:
            shutil.rmtree(ckpt, ignore_errors=True)


def read_state(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--resume {ckpt}: not a complete areno checkpoint ({e})") from None


def check_checkpoint(ckpt: Path) -> dict:
    """A checkpoint --resume may start from: its trainer state (returned), its model
    files whole (modeldir.py) and the optimizer state of backend/. UserError naming
    what is missing or cut short, and the checkpoint to pass instead."""
    state = read_state(ckpt)
    instead = instead_of(ckpt)
    check_model_dir(ckpt, "--resume", instead)
    backend = ckpt / "backend"
    for need, what in ((backend / "optim" / ".metadata", "the optimizer state (backend/optim)"),
                       (backend / "trainer.pt", "the LR schedule state (backend/trainer.pt)")):
        if not need.is_file():
            raise UserError(f"--resume {ckpt}: {what} is missing; {instead}")
    return state


def instead_of(ckpt: Path) -> str:
    """What to do when checkpoint `ckpt` cannot be resumed: the newest other one beside it, or start again."""
    others = [p for p in list_checkpoints(ckpt.parent) if p != ckpt]
    return (f"resume from another checkpoint (--resume {others[-1]})" if others else
            "start the run again without --resume (no other checkpoint is there)")


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
