"""--log-completions: a few sampled completions per step in completions.jsonl,
one on the terminal every SAMPLE_EVERY steps; and the run's first line says when
--epochs ends the run before --max-steps (issue 17, first contact)."""

from __future__ import annotations

import json

import numpy as np

from areno.rundir.completions import sample_indices
from areno.rundir.reporting import LINE_LIMIT, SAMPLE_EVERY, format_sample_line, limit_note
from inprocess import run_here

FIELDS = {"step", "sample", "prompt", "completion", "reward", "advantage", "finish_reason"}


def test_sample_indices_are_distinct_spread_over_the_batch_and_move_with_the_step():
    idx = sample_indices(128, 4, step=1)
    assert idx.tolist() == [1, 33, 65, 97]
    assert sample_indices(128, 4, step=2).tolist() == [2, 34, 66, 98]
    assert sorted(set(sample_indices(3, 5, step=7).tolist())) == [0, 1, 2]  # never more than R
    assert sample_indices(0, 2, step=1).size == 0
    assert np.unique(sample_indices(10, 7, step=123)).size == 7


def test_a_sample_line_fits_the_terminal_line_and_escapes_newlines():
    rec = {"step": 11, "sample": 3, "prompt": "<|im_start|>user\n" + "x" * 300 + " What is 2+2?",
           "completion": "Let me think.\n" * 40, "reward": 1.0, "advantage": 0.4375,
           "finish_reason": "length"}
    line = format_sample_line(rec)
    assert len(line) <= LINE_LIMIT and "\n" not in line, line
    assert line.startswith('  sample of step 11: "…') and "What is 2+2?\" -> \"Let me think.\\n" in line
    assert line.endswith('…" reward 1.00 adv +0.44 length') and len(line) == LINE_LIMIT
    short = format_sample_line({**rec, "prompt": "3+4=", "completion": "7", "reward": None})
    assert short == '  sample of step 11: "3+4=" -> "7" reward none adv +0.44 length'


def test_limit_note_names_the_limit_that_cut_the_other():
    assert limit_note(3000, 5000, 1000, 55, 16) == (
        "--epochs 1000 over 55 prompts at 16 per step ends before --max-steps 5000")
    assert limit_note(600, 600, 1000, 55, 16) == ""  # --max-steps came first, as asked
    assert limit_note(30, 0, 10, 55, 16) == ""  # no --max-steps


def test_a_run_writes_its_completions_and_says_when_epochs_cut_max_steps(tmp_path, areno_cache):
    out = tmp_path / "run"
    res = run_here(["train", "--epochs", "1", "--max-steps", "5000", "--log-completions", "3", "--no-save",
                    "--output-dir", str(out)], areno_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    note = ", 3 steps of 16x8 (--epochs 1 over 55 prompts at 16 per step ends before --max-steps 5000);"
    assert lines[0].startswith("areno: ") and note in lines[0], lines[0]
    recs = [json.loads(ln) for ln in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(set(r) == FIELDS for r in recs)
    assert all(r["finish_reason"] in ("stop", "length") and isinstance(r["completion"], str)
               and "+" in r["prompt"] and isinstance(r["advantage"], float) for r in recs)
    samples = [ln for ln in lines if ln.startswith("  sample of step ")]
    assert SAMPLE_EVERY > 3 and len(samples) == 1 and samples[0].startswith("  sample of step 1: "), lines
    assert lines.index(samples[0]) == 1 + next(i for i, ln in enumerate(lines) if ln.startswith("step 1/3"))
