"""The per-step console line (README: "one line per step"): at most 120
characters, never wrapped when the output is not a terminal, failed rewards
shown whenever there are any, no LR for a step without an optimizer step."""

from __future__ import annotations

import io

from rich.console import Console

from areno.reporting import LINE_LIMIT, RunLogger, format_step_line

STEP = {"reward/mean": 0.3125, "reward/std": 0.205, "reward/accuracy": 0.25,
        "response/len_mean": 2.8, "response/len_max": 3.0, "train/kl": 0.0012,
        "train/clip_frac": 0.0, "train/grad_norm": 1.935, "train/lr": 2.32e-4,
        "time/rollout": 0.08, "time/materialize": 0.01, "time/weight_sync": 0.02,
        "time/step": 0.35, "perf/tokens_per_s": 274.0, "reward/valid": 16.0}
# Long values everywhere, and failed rewards.
WIDE = {**STEP, "response/len_mean": 1023.7, "response/len_max": 4096.0, "time/step": 1234.5,
        "perf/tokens_per_s": 123456.0, "train/grad_norm": 123.456, "train/kl": 12.5,
        "reward/valid": 500.0, "reward/zeroed": 12.0, "reward/timeouts": 12.0}


def test_step_line_holds_the_key_figures_in_120_characters_without_phase_times():
    line = format_step_line(3, 200, STEP)
    assert line == ("step 3/200 reward 0.312±0.205 acc 0.25 len 2.8/3 kl 0.0012 clip 0.000 "
                    "gnorm 1.94 lr 2.3e-04 0.35s 274 tok/s")
    wide = format_step_line(10000, 10000, WIDE)
    assert len(wide) <= LINE_LIMIT and "\n" not in wide
    assert "reward 0.312±0.205 (12/500 failed)" in wide and "len 1024/4096" in wide
    assert not any(p in line for p in ("rollout", "decode", "materi", "weight"))  # in the JSONL


def test_failed_rewards_show_and_a_step_with_no_valid_reward_warns_and_shows_no_lr():
    assert "failed" not in format_step_line(1, 2, STEP)
    zeroed = {**STEP, "reward/zeroed": 16.0, "reward/timeouts": 16.0, "reward/mean": 0.0}
    assert "reward 0.000±0.205 (WARN: all 16 failed)" in format_step_line(1, 2, zeroed)
    skipped = {**STEP, "reward/valid": 0.0, "reward/skipped": 16.0, "train/lr": 0.0,
               "train/kl": 0.0, "train/grad_norm": 0.0}
    line = format_step_line(1, 2, skipped)
    assert "(WARN: all 16 failed)" in line and "no update" in line
    assert " lr " not in line and "gnorm" not in line


def test_step_line_is_not_wrapped_on_a_narrow_non_terminal_console(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    with RunLogger(tmp_path, 200, console=console) as logger:
        logger.info("areno: " + "x" * 150)
        logger.log(10000, WIDE)
    lines = out.getvalue().splitlines()
    assert "areno: " + "x" * 150 in lines
    assert format_step_line(10000, 200, WIDE) in lines
