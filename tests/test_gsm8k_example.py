"""examples/math: the GSM8K row loader and math-verify reward, through load_rows + RewardScorer."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import datasets.config
import pytest

from areno.rewards import RewardRecord, RewardScorer
from areno.data.rows import load_rows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "math"
LOADER = str(EXAMPLES / "dataset_loader.py")
REWARD = str(EXAMPLES / "math_verify_reward.py")

# Rows in the format of GSM8K's train/test.jsonl (question, worked answer ending in "#### N").
GSM8K_ROWS = [
    {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast and bakes muffins "
                 "with four. She sells the rest for $2 each. How much does she make every day?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
               "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. "
                 "How many bolts in total does it take?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3"},
    {"question": "Josh buys a house for $80,000 and puts in $50,000 in repairs, increasing its value "
                 "by 150%. How much profit did he make?",
     "answer": "The cost was 80,000+50,000=$<<80000+50000=130000>>130,000\n"
               "The new value is 200,000\nSo he made 200,000-130,000=$<<200000-130000=70000>>70,000\n"
               "#### 70,000"},
]


@pytest.fixture
def gsm8k_file(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    return str(path)


def records(rows, completions):
    return [
        RewardRecord(prompt=row["prompt"], completion=c, answer=row["answer"], solutions=None, row=row,
                     num_tokens=len(c.split()), finish_reason="stop", index=i)
        for i, (row, c) in enumerate(zip(rows, completions))
    ]


def test_loader_turns_gsm8k_rows_into_prompts_and_final_answers(gsm8k_file):
    rs = load_rows(gsm8k_file, loader_fn=LOADER)
    assert [r["answer"] for r in rs.rows] == ["18", "3", "70000"]
    assert all(r["prompt"].startswith(g["question"][:20]) and "####" in r["prompt"]
               for r, g in zip(rs.rows, GSM8K_ROWS))
    assert rs.rows[0]["solution"] == GSM8K_ROWS[0]["answer"]
    # The built-in normalization reads the same answers without a loader.
    assert [r["answer"] for r in load_rows(gsm8k_file).rows] == ["18", "3", "70000"]


def test_loader_reports_a_row_without_a_final_answer(gsm8k_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K_ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    from areno.errors import UserError

    with pytest.raises(UserError, match=r"row 1: loader_fn raised ValueError: the 'answer' field has no"):
        load_rows(str(bad), loader_fn=LOADER)
    assert load_rows(str(bad), loader_fn=LOADER, skip_bad_rows=True).skipped == 1


COMPLETIONS = [
    "She sells 9 eggs and makes 9 * 2 = 18 dollars.\n#### 18",  # right, after ####
    "White fiber is 1 bolt, so 2 + 1 = 3. The answer is \\boxed{3}.",  # right, boxed
    "He made 200,000 - 130,000 = 70,000 dollars.\n#### 70,000",  # right, with commas
]
WRONG = ["#### 17", "The answer is \\boxed{4}.", "I am not sure."]


@pytest.mark.parametrize("workers", [1, 0])
def test_math_verify_reward_scores_right_and_wrong_answers(gsm8k_file, workers):
    rows = load_rows(gsm8k_file, loader_fn=LOADER).rows
    with RewardScorer(REWARD, workers=workers, timeout=30.0) as scorer:
        r = scorer.score(records(rows * 2, COMPLETIONS + WRONG))
    assert r.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert r.counts.failures == 0


@pytest.mark.alone
def test_signal_timeouts_like_math_verify_work_inside_reward_workers(tmp_path):
    # math-verify bounds parse/verify with SIGALRM, which only works in a main
    # thread: reward workers run the plugin in theirs, so its own limit fires
    # (here after 1 s) well before areno's kill (30 s).
    plugin = tmp_path / "slow.py"
    plugin.write_text(textwrap.dedent("""
        import time
        from math_verify.utils import timeout

        def reward_fn(record):
            timeout(timeout_seconds=1)(time.sleep)(60)
            return 1.0
    """))
    with RewardScorer(str(plugin), workers=1, timeout=30.0, on_error="skip") as scorer:
        t0 = time.monotonic()
        r = scorer.score(records([{"prompt": "p", "answer": "1"}], ["x"]))
    assert time.monotonic() - t0 < 10
    assert r.counts.errors == 1 and r.counts.timeouts == 0
    assert "TimeoutException" in r.messages[0]


def test_math_verify_reward_in_process_from_a_thread_skips_the_signal_limit(gsm8k_file):
    # workers=0 called from a non-main thread: SIGALRM is unusable there, so the
    # example passes no limit instead of letting math-verify raise.
    import threading

    rows = load_rows(gsm8k_file, loader_fn=LOADER).rows
    out = {}
    with RewardScorer(REWARD, workers=0) as scorer:
        t = threading.Thread(target=lambda: out.update(r=scorer.score(records(rows, COMPLETIONS))))
        t.start()
        t.join(60)
    assert out["r"].rewards.tolist() == [1.0, 1.0, 1.0] and out["r"].counts.failures == 0
