"""scripts/bench_step_commits.py: its order interleaves the revisions, its medians
leave out step 1, its ratio is new over old, it adapts the flags to an older
CLI, and its worktrees come and go (the real-model runs themselves take minutes
each: docs/PERFORMANCE.md quotes them)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arenobench.step_commits import (
    RunSpec, command, markdown, parse_threads, phase_medians, schedule, summarize, supported,
    train_flags, worktrees,
)

REPO = Path(__file__).resolve().parents[1]


def test_schedule_interleaves_and_flips_the_order_every_repeat():
    order = [(s.rev, s.threads_label) for s in schedule(["old", "new"], parse_threads("2,default"), 2)]
    assert order == [("old", "2"), ("new", "2"), ("old", "default"), ("new", "default"),
                     ("new", "2"), ("old", "2"), ("new", "default"), ("old", "default")]


def test_phase_medians_leave_out_the_first_step():
    recs = [{"step": 1, "time/train": 100.0, "time/weight_sync": 9.0, "time/rollout": 50.0, "time/step": 160.0},
            {"step": 2, "time/train": 2.0, "time/weight_sync": 1.0, "time/rollout": 3.0, "time/step": 6.0},
            {"step": 3, "time/train": 4.0, "time/weight_sync": 1.0, "time/rollout": 5.0, "time/step": 10.0},
            {"event": "done"}]
    assert phase_medians(recs) == {"train": 3.0, "weight_sync": 1.0, "rollout": 4.0, "step": 8.0}


def test_summary_gives_medians_over_repeats_and_new_over_old():
    res = [(RunSpec("a", 2), {"train": 10.0}), (RunSpec("b", 2), {"train": 13.0}),
           (RunSpec("b", 2), {"train": 15.0}), (RunSpec("a", 2), {"train": 12.0}),
           (RunSpec("a", 2), {"train": 11.0}), (RunSpec("b", 2), {"train": 99.0})]
    row = next(r for r in summarize(res, ["a", "b"]) if r["phase"] == "train")
    assert (row["a"], row["b"], row["n_a"]) == (11.0, 15.0, 3)
    assert row["ratio"] == pytest.approx(15.0 / 11.0)
    assert "| 2 | train | 11.00 | 15.00 | 1.36x |" in markdown(summarize(res, ["a", "b"]), ["a", "b"])


def test_flags_an_older_cli_lacks_are_dropped_and_default_threads_pass_no_flag(tmp_path: Path):
    args = argparse.Namespace(prompts=8, samples=8, new_tokens=16, steps=3)
    flags = train_flags(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r.py", args)
    old_help = " ".join(k for k in flags if k != "--log-completions")
    kept = supported(flags, old_help)
    assert "--log-completions" not in kept and len(kept) == len(flags) - 1
    argv = command(kept, None, tmp_path / "out")
    assert "--cpu-threads" not in argv and argv[argv.index("--batch-size") + 1] == "8"
    assert command(kept, 2, tmp_path / "out")[-2:] == ["--cpu-threads", "2"]


def test_this_cli_takes_every_flag_the_bench_passes(tmp_path: Path):
    """A renamed flag would silently leave the bench's runs unlike each other."""
    args = argparse.Namespace(prompts=8, samples=8, new_tokens=16, steps=3)
    flags = train_flags(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "r.py", args)
    res = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--help"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "300"},
                         capture_output=True, text=True, timeout=120)
    assert supported(flags, res.stdout) == flags, set(flags) - set(supported(flags, res.stdout))
    assert "--cpu-threads" in res.stdout


def test_worktrees_check_out_each_revision_and_are_removed(tmp_path: Path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    with worktrees(["HEAD"], tmp_path) as trees:
        tree = trees["HEAD"]
        assert (tree / "areno" / "trainer.py").exists()
        got = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert got == head
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed


def test_ref_compares_this_checkout_as_it_is_against_the_revision(tmp_path: Path):
    """--ref REV is --revs REV . ; '.' is this checkout itself (uncommitted
    changes included), for which no worktree is made."""
    from arenobench.refs import CURRENT, rev_id
    from arenobench.step_commits import parse_args

    args = parse_args(["--ref", "HEAD"])
    assert args.ref == "HEAD" and rev_id(CURRENT) == CURRENT
    with worktrees(["HEAD", CURRENT], tmp_path) as trees:
        assert trees[CURRENT] == REPO and trees["HEAD"] != REPO and trees["HEAD"].is_relative_to(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert "| 2 | train | 1.00 | 2.00 | 2.00x |" in markdown(
        summarize([(RunSpec("abc", 2), {"train": 1.0}), (RunSpec(CURRENT, 2), {"train": 2.0})], ["abc", CURRENT]),
        ["abc", CURRENT])
