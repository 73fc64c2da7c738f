"""The options of the off-policy corrections, the overlong punishment and dynamic
sampling (issue 27, 3 and 4): refusals are one line with exit 2; today's behaviour
is the default; what is given reaches the loss (LossConfig) and, for the overlong
punishment, the advantages of a run."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import refused
from areno.settings import backend_config
from areno.config.train import TrainConfig
from areno.losses import LossConfig

CAP = ["--recompute-logprobs", "--tis-cap", "2"]


BAD = [
    (["--is-level", "sequence"], "--is-level sequence needs --tis-cap"),
    (["--is-mode", "mask"], "--is-mode mask needs --tis-cap"),
    (["--is-level", "bogus", *CAP], "--is-level"),
    ([*CAP, "--is-mask-low", "0.5"], "--is-mask-low 0.5 is the lower edge of --is-mode mask's band"),
    ([*CAP, "--is-mode", "mask", "--is-mask-low", "2"], "--is-mask-low 2 must be below --tis-cap 2"),
    (["--max-new-tokens", "8", "--overlong-buffer", "9"], "--overlong-buffer 9 exceeds --max-new-tokens 8"),
    (["--overlong-penalty", "-1"], "--overlong-penalty must be >= 0"),
    (["--dynamic-sampling", "variance"], "--dynamic-sampling"),
    (["--dynamic-sampling", "accuracy", "--max-sampling-rounds", "0"], "--max-sampling-rounds must be >= 1"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_each_refusal_is_one_line_exit_2(args, needle, capsys):
    assert needle in refused(args, capsys)


def test_defaults_are_todays_token_truncation_and_no_punishment(files):
    cfg = TrainConfig.from_sources(None, dict(files))
    assert (cfg.is_level, cfg.is_mode, cfg.is_mask_low, cfg.overlong_buffer) == ("token", "truncate", 0, 0)
    assert backend_config(cfg, "m", "m", 1, "cpu", 10).loss == LossConfig()


def test_given_options_reach_the_loss(files):
    cfg = TrainConfig.from_sources(None, {**files, "recompute_logprobs": True, "tis_cap": 3.0,
                                          "is_level": "geometric", "is_mode": "mask",
                                          "is_mask_low": 0.25})
    loss = backend_config(cfg, "m", "m", 1, "cpu", 10).loss
    assert (loss.tis_cap, loss.is_level, loss.is_mode, loss.is_mask_low) == (3.0, "geometric", "mask", 0.25)


def test_the_overlong_punishment_reaches_the_advantages_of_a_run(tmp_path, areno_cache):
    """The demo at --max-new-tokens 8 with --overlong-buffer 1 --overlong-penalty 0.5:
    a completion cut at 8 tokens loses 0.5, a shorter one nothing (a stop at exactly
    8 tokens would lose it too: this seeded run has none), before the advantages;
    the logged advantages are those of the punished rewards."""
    import json

    from inprocess import run_here
    from test_resume import HF1, ok

    from areno.advantages import group_advantages

    out = tmp_path / "run"
    ok(run_here(["train", *HF1, "--max-steps", "1", "--no-save", "--max-new-tokens", "8",
                 "--overlong-buffer", "1", "--overlong-penalty", "0.5", "--log-completions", "16",
                 "--output-dir", str(out)], areno_cache))
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    recs = sorted((json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()),
                  key=lambda r: r["sample"])
    assert [r["sample"] for r in recs] == list(range(16))  # every sample (4 groups of 4)
    cut = np.array([r["finish_reason"] == "length" for r in recs])
    assert 0 < cut.sum() < 16  # some punished, some not
    assert row["reward/overlong_penalty"] == pytest.approx(-0.5 * cut.mean())
    shaped = np.array([r["reward"] for r in recs]) - 0.5 * cut
    np.testing.assert_allclose([r["advantage"] for r in recs],
                               group_advantages(shaped, np.repeat(np.arange(4), 4)), rtol=1e-5, atol=1e-6)
