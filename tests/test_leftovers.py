"""Shared memory of dead areno processes is removed at the next start."""

from __future__ import annotations

import os
import subprocess

import psutil

from areno.runtime.leftovers import remove_dead_segments


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_segments_of_dead_or_reused_pids_go_and_live_owners_keep_theirs(tmp_path):
    dead = tmp_path / f"areno-bk-{dead_pid()}-1a2b3c4d-pack"
    dead.write_bytes(b"x" * 4096)
    weights = tmp_path / f"areno-weights-{dead_pid()}-abcd1234"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"y" * 100)
    mine = tmp_path / f"areno-bk-{os.getpid()}-00000000-pack"
    mine.write_bytes(b"z")
    # Our pid, but written before we started: a pid the dead owner's was reused as.
    reused = tmp_path / f"areno-bk-{os.getpid()}-11111111-marker"
    reused.write_bytes(b"r")
    before = psutil.Process().create_time() - 60
    os.utime(reused, (before, before))
    other = tmp_path / f"vllm-{dead_pid()}"
    other.write_bytes(b"o")

    removed = dict(remove_dead_segments(tmp_path))
    assert removed == {dead: 4096, weights: 100, reused: 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])
