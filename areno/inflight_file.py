"""The checkpoint's file of the rounds in flight (scheduler.py): each round's
untrained groups as a RolloutBatch with its prompt indices, a multi-turn
round's rewards (they cannot be computed again) and its halted trajectories'
books (envs/halted.py), and each round's tag, weight version and sampler state
before its prompts. Read whole before anything starts, or refused in one line."""

from __future__ import annotations

import json
import pickle
import zipfile
from dataclasses import fields
from pathlib import Path

import numpy as np

from areno import first_finished
from areno.continuation import any_halted
from areno.errors import UserError, one_line
from areno.inflight import Inflight
from areno.rewards import RewardCounts, RewardResult
from areno.rollout.batch import RolloutBatch
from areno.rundir.checkpoint import STATE_FILE

INFLIGHT_FILE = "inflight.npz"  # each round's RolloutBatch and prompt indices (and env rewards)
INFLIGHT_META = "inflight.json"  # each one's tag, weight version, the sampler before its prompts


def save_inflight(path: Path, inflight: list[Inflight]) -> None:
    """Every round of `inflight` into checkpoint dir `path` (a pending one waited for)."""
    arrays = {}
    for i, cur in enumerate(inflight):
        if cur.round is not None:
            batch, scored = cur.round.batch, cur.round.scored
        elif cur.saved is not None:
            batch, scored = cur.saved
        else:
            batch, scored = cur.pending.batch()
        prompt_idx, batch, scored = first_finished.remaining(cur, batch, scored)  # its untrained groups
        arrays |= {f"{i}/{f.name}": getattr(batch, f.name) for f in fields(RolloutBatch)
                   if getattr(batch, f.name) is not None}  # response_mask: multi-turn only
        arrays[f"{i}/prompt_idx"] = prompt_idx
        if scored is not None and batch.response_mask is not None:  # an environment's rewards
            arrays[f"{i}/rewards"], arrays[f"{i}/valid"] = scored.rewards, scored.valid
            if any_halted(batch, scored):  # and its halted trajectories' books (envs/halted.py)
                arrays[f"{i}/halted"] = np.frombuffer(pickle.dumps(scored.payloads), np.uint8)
    if inflight:
        np.savez(path / INFLIGHT_FILE, **arrays)
        (path / INFLIGHT_META).write_text(json.dumps({"rollouts": [
            {"step": c.step, "version": c.version, "sampler_before": c.sampler_before}
            for c in inflight]}))


def load_inflight(ckpt: Path | None, expected: int | None = None, instead: str = "") -> list[Inflight]:
    """The rollouts a checkpoint saved in flight (save_inflight), oldest first,
    read whole before anything starts: without them the resumed run would train on
    other prompts than the saved one (the sampler's cursor is past theirs), so a
    missing, truncated or short file is a UserError naming it (instead: what to
    pass then). expected: the count the trainer state records (None: a checkpoint
    from before it did; then the files are read when there). A checkpoint of the
    one-rollout loop (one unprefixed rollout) reads too."""
    if ckpt is None:
        return []
    npz, meta_path = ckpt / INFLIGHT_FILE, ckpt / INFLIGHT_META
    if not expected and not npz.exists() and not meta_path.exists():
        return []
    try:
        return _read_inflight(npz, meta_path, expected)
    except _Damaged as e:
        name, problem = e.args
        raise UserError(f"--resume {ckpt}: {name} (the rollouts in flight when it was saved) {problem}; "
                        f"{instead or 'resume from another checkpoint'}") from None


class _Damaged(Exception):
    """An in-flight file's name and what is wrong with it."""


def _read_inflight(npz: Path, meta_path: Path, expected: int | None) -> list[Inflight]:
    for f in (meta_path, npz):
        if not f.is_file():
            raise _Damaged(f.name, "is missing")
    try:
        meta = json.loads(meta_path.read_text())
        rollouts, prefix = (meta["rollouts"], "{}/") if "rollouts" in meta else ([meta], "")
        for m in rollouts:
            m["step"], m["version"], m["sampler_before"]  # noqa: B018  (each one whole)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Damaged(meta_path.name, f"is truncated or unreadable ({one_line(e)})") from None
    if expected is not None and len(rollouts) != expected:
        raise _Damaged(meta_path.name, f"lists {len(rollouts)} rollouts, {STATE_FILE} {expected}")
    out = []
    try:
        with np.load(npz) as z:
            for i, m in enumerate(rollouts):
                p = prefix.format(i)
                # Indexing reads and CRC-checks each array: a cut file fails here.
                batch = RolloutBatch(**{f.name: z[p + f.name] for f in fields(RolloutBatch) if p + f.name in z})
                scored = RewardResult(z[p + "rewards"], z[p + "valid"], RewardCounts(),
                                      payloads=pickle.loads(z[p + "halted"].tobytes()) if p + "halted" in z
                                      else None) \
                    if p + "rewards" in z else None  # an environment's: they cannot be computed again
                out.append(Inflight(m["step"], z[p + "prompt_idx"], m["sampler_before"], m["version"],
                                    saved=(batch, scored)))
    # the halted trajectories' states unpickle too: a class the environment's file
    # defined must import by the same name (ImportError, AttributeError otherwise)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError,
            ImportError, AttributeError) as e:
        raise _Damaged(npz.name, f"is truncated or unreadable ({one_line(e)})") from None
    return out
