"""The per-step console line (README: "one line per step"): at most 120
characters, never wrapped when the output is not a terminal, failed rewards
shown whenever there are any, no LR for a step without an optimizer step."""

from __future__ import annotations

import io

from rich.console import Console

import json
import math

from areno.rundir.reporting import LINE_LIMIT, RunLogger, format_step_line, read_metrics, truncate_metrics

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


def test_split_placement_says_which_side_waited_for_the_other():
    split = {**STEP, "time/wait_batch": 0.004, "time/wait_weights": 0.27}
    assert format_step_line(3, 200, split).endswith(" 0.35s engines idle 0.27s")  # tok/s dropped: 120
    split["time/wait_batch"] = 0.5  # the engines are the slow side: the ranks wait for the batch
    assert " 0.35s ranks idle 0.50s" in format_step_line(3, 200, split)
    assert len(format_step_line(10000, 10000, {**WIDE, **split})) <= LINE_LIMIT


def test_failed_rewards_show_and_a_step_with_no_valid_reward_warns_and_shows_no_lr():
    assert "failed" not in format_step_line(1, 2, STEP)
    zeroed = {**STEP, "reward/zeroed": 16.0, "reward/timeouts": 16.0, "reward/mean": 0.0}
    assert "reward 0.000±0.205 (WARN: all 16 failed)" in format_step_line(1, 2, zeroed)
    skipped = {**STEP, "reward/valid": 0.0, "reward/skipped": 16.0, "train/lr": 0.0,
               "train/kl": 0.0, "train/grad_norm": 0.0}
    line = format_step_line(1, 2, skipped)
    assert "(WARN: all 16 failed)" in line and "no update" in line
    assert " lr " not in line and "gnorm" not in line


def test_a_dynamic_sampling_step_that_kept_no_group_says_why_it_made_no_update():
    m = {**STEP, "train/lr": 0.0, "sampling/rounds": 4.0, "sampling/groups_kept": 0.0}
    line = format_step_line(1, 2, m)
    assert " no update: no informative group in 4 rounds " in line, line
    wide = {**WIDE, "train/lr": 0.0, "sampling/rounds": 99.0, "sampling/groups_kept": 0.0}
    assert "no informative group in 99 rounds" in format_step_line(10000, 10000, wide)
    assert len(format_step_line(10000, 10000, wide)) <= LINE_LIMIT
    assert "no update:" not in format_step_line(1, 2, {**m, "sampling/groups_kept": 3.0})


def test_step_line_is_not_wrapped_on_a_narrow_non_terminal_console(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    with RunLogger(tmp_path, 200, console=console) as logger:
        logger.info("areno: " + "x" * 150)
        logger.log(10000, WIDE)
    lines = out.getvalue().splitlines()
    assert "areno: " + "x" * 150 in lines
    assert format_step_line(10000, 200, WIDE, show_kl=False) in lines  # no kl_coef in config


def _strict(line: str) -> dict:
    def refuse(name):
        raise ValueError(name)

    return json.loads(line, parse_constant=refuse)


def test_metrics_jsonl_never_holds_nan_or_infinity_and_the_step_line_still_shows_them(tmp_path):
    """Issue 18: a non-finite metric is left out of its record (strict JSON
    parses every line), also when a resume rewrites the file; the console says nan."""
    out = io.StringIO()
    bad = {**STEP, "train/grad_norm": math.inf, "train/kl": -math.inf, "rollout/logprob_std": math.nan}
    with RunLogger(tmp_path, 3, console=Console(file=out, width=500)) as logger:
        logger.log(1, STEP)
        logger.log(2, bad)
        logger.log(3, bad)
    records = [_strict(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["train/grad_norm"] == STEP["train/grad_norm"]
    assert not {"train/grad_norm", "train/kl", "rollout/logprob_std"} & set(records[1])
    assert records[1]["reward/mean"] == STEP["reward/mean"]
    assert "gnorm nan" in out.getvalue()
    truncate_metrics(tmp_path / "metrics.jsonl", 2)
    assert [_strict(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert read_metrics(tmp_path / "metrics.jsonl")[1] == records[1]


def test_kl_is_on_the_step_line_only_with_a_reference_model(tmp_path):
    """kl_coef 0 loads no reference model: train/kl is 0 by construction (issue 18)."""
    assert " kl " not in format_step_line(3, 200, STEP, show_kl=False)
    assert " kl 0.0012 " in format_step_line(3, 200, STEP, show_kl=True)
    for coef, shown in ((0.0, False), (0.05, True)):
        out = io.StringIO()
        with RunLogger(tmp_path / str(coef), 3, console=Console(file=out, width=500),
                       config={"kl_coef": coef}) as logger:
            logger.log(1, STEP)
        assert (" kl 0.0012 " in out.getvalue()) is shown, out.getvalue()
