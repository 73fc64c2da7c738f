"""Held-out eval (greedy pass@1, mean@k / pass@k; at step 0, every
--eval-interval and at the end; --eval-only on a checkpoint) and `areno plot`.

evaluate() is checked exactly against a scripted engine; the run-level
behaviour through one small `areno train` run and one `--eval-only` run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from areno.rollout.batch import FINISH_STOP, RolloutBatch, offsets_from_lengths
from helpers import InProcessEngines
from inprocess import run_here
from test_resume import DIGIT_REWARD, EVAL_ROWS, HF1, ok, read_metrics, train_steps


class ScriptedEngine:
    """Answers prompt p with script[(greedy?)][p][j] for sample j."""

    def __init__(self, tokenizer, greedy: list[str], sampled: list[list[str]]) -> None:
        self.tok, self.greedy, self.sampled = tokenizer, greedy, sampled
        self.calls: list = []

    def generate(self, ids, offsets, n, sampling):
        self.calls.append((n, sampling))
        texts = ([[g] for g in self.greedy] if sampling.temperature == 0 else self.sampled)
        P = len(offsets) - 1
        resp = [self.tok.encode(texts[p][j], add_special_tokens=False) for p in range(P) for j in range(n)]
        lengths = np.array([len(r) for r in resp])
        return RolloutBatch(
            prompt_ids=ids, prompt_offsets=offsets,
            response_ids=np.concatenate(resp).astype(np.int32),
            response_offsets=offsets_from_lengths(lengths),
            response_logprobs=np.zeros(lengths.sum(), np.float32),
            group_index=np.repeat(np.arange(P), n).astype(np.int64),
            finish_reason=np.full(P * n, FINISH_STOP, np.uint8),
        )


def test_evaluate_scores_greedy_pass_at_1_and_mean_and_pass_at_k(tmp_path, tiny_arith_path):
    from transformers import AutoTokenizer

    from types import SimpleNamespace

    from areno.evaluate import evaluate
    from areno.data.prompts import tokenize_prompts
    from areno.producers import Data, Producer
    from areno.rewards import RewardScorer
    from areno.rollout.engine import SamplingConfig
    from areno.data.rows import normalize_rows
    from areno.timing import PhaseTimer

    tok = AutoTokenizer.from_pretrained(tiny_arith_path)
    rows = normalize_rows(EVAL_ROWS[:4], source="test")
    prompts = tokenize_prompts(rows, tok, use_chat_template=False, max_prompt_len=16)
    plugin = tmp_path / "digit.py"
    plugin.write_text(DIGIT_REWARD)
    # answers 3, 7, 5, 4
    engine = ScriptedEngine(tok, greedy=["3", "1", "+", "4"],  # 1, 0.5, 0, 1
                            sampled=[["3", "3", "3"], ["1", "+", "1"], ["+", "+", "5"],
                                     ["0", "0", "0"]])
    with RewardScorer(str(plugin), workers=0) as scorer:
        run = SimpleNamespace(cfg=SimpleNamespace(), engine=InProcessEngines(engine), tokenizer=tok,
                              scorer=scorer)
        producer = Producer(run, None)  # the eval round: the training rounds' producer, colocated

        def run_round(data, n, sampling):
            idx = np.arange(len(data.prompts), dtype=np.int64)
            return producer.start(data, idx, n, sampling, overlap=False).collect(PhaseTimer())
        m = evaluate(run_round, Data(rows, prompts), SamplingConfig(temperature=0.7, seed=5), k=3)
    assert m == pytest.approx({
        "eval/pass@1": 2 / 4, "eval/reward@1": 2.5 / 4, "eval/prompts": 4.0,
        "eval/mean@3": (3 + 1 + 1 + 1.5) / 12, "eval/pass@3": 2 / 4,
    })
    (n1, greedy), (n3, sampled) = engine.calls
    assert (n1, greedy.temperature, greedy.top_p, greedy.top_k) == (1, 0.0, 1.0, -1)
    assert (n3, sampled.temperature, sampled.seed) == (3, 0.7, 5)


# -- end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, areno_cache) -> tuple[Path, Path, Path]:
    """3 demo steps with a held-out set: eval at 0, 2 (interval) and 3 (end)."""
    d = tmp_path_factory.mktemp("eval")
    data, plugin, out = d / "eval.jsonl", d / "digit.py", d / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
    plugin.write_text(DIGIT_REWARD)
    res = ok(run_here(["train", *HF1, "--max-steps", "3", "--eval-dataset-path", str(data),
                       "--eval-interval", "2", "--eval-n", "2", "--reward-fn-path", str(plugin),
                       "--output-dir", str(out)], areno_cache))
    (out / "stdout.txt").write_text(res.stdout)
    return out, data, plugin


def eval_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "eval/pass@1" in r}


def test_eval_runs_at_step_0_every_interval_and_at_the_end(eval_run):
    out, _, _ = eval_run
    evals = eval_records(out)
    assert sorted(evals) == [0, 2, 3]
    for r in evals.values():
        assert set(r) == {"step", "eval/pass@1", "eval/reward@1", "eval/prompts", "eval/mean@2",
                          "eval/pass@2"}
        assert r["eval/prompts"] == len(EVAL_ROWS)
        assert 0 <= r["eval/pass@1"] <= r["eval/reward@1"] <= 1 and 0 <= r["eval/mean@2"] <= 1
    assert any(r["eval/reward@1"] > 0 or r["eval/mean@2"] > 0 for r in evals.values())
    stdout = (out / "stdout.txt").read_text()
    for s in (0, 2, 3):
        assert f"eval step {s}: pass@1" in stdout
    assert sorted(train_steps(out)) == [1, 2, 3]


def test_eval_only_scores_a_checkpoint_as_the_run_did(eval_run, tmp_path, areno_cache):
    out, data, plugin = eval_run
    ckpt = out / "checkpoints" / "step_000003"
    res = ok(run_here(["train", "--eval-only", "--ckpt", str(ckpt), "--eval-dataset-path", str(data),
                       "--reward-fn-path", str(plugin), "--no-chat-template", "--max-new-tokens", "3",
                       "--max-prompt-len", "16", "--rollout-engine", "hf", "--reward-workers", "0",
                       "--output-dir", str(tmp_path / "ev")], areno_cache))
    assert "eval step 0: pass@1" in res.stdout
    records = read_metrics(tmp_path / "ev")
    assert len(records) == 1 and "reward/mean" not in records[0]  # no training
    assert not (tmp_path / "ev" / "checkpoints").exists()
    final = eval_records(out)[3]
    for key in ("eval/pass@1", "eval/reward@1"):  # greedy: the same weights give the same score
        assert records[0][key] == final[key], key


def test_plot_has_one_point_per_step_in_a_png_of_the_documented_size(eval_run, tmp_path):
    import matplotlib.image as mpimg

    from areno.cli.plot import DPI, FIGSIZE, plot_run

    out, _, _ = eval_run
    png, fig = plot_run(out, tmp_path / "m.png")
    assert png == tmp_path / "m.png"
    h, w = mpimg.imread(png).shape[:2]
    assert (w, h) == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    titles = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(titles) == {"reward", "response length (tokens)", "eval (held-out)", "KL",
                           "clip fraction", "seconds per phase"}
    for title, ax in titles.items():
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert lines, title
        for label, ln in lines.items():
            is_eval = label == "eval pass@1" or title == "eval (held-out)"
            assert list(ln.get_xdata()) == ([0, 2, 3] if is_eval else [1, 2, 3]), (title, label)
    assert {"reward", "accuracy", "eval pass@1"} == set(ln.get_label() for ln in titles["reward"].get_lines())
    assert {"pass@1", "reward@1", "mean@2", "pass@2"} == set(
        ln.get_label() for ln in titles["eval (held-out)"].get_lines())
    assert {"rollout", "train", "weight_sync"} <= set(
        ln.get_label() for ln in titles["seconds per phase"].get_lines())


def test_plot_scales_phases_by_the_steady_steps_and_keeps_kl_and_clip_apart(tmp_path):
    from areno.cli.plot import HEADROOM, plot_run

    steps = [{"step": s, "reward/mean": 0.1, "response/len_mean": 2.0, "response/len_max": 3.0,
              "train/kl": 1e-4 * s, "train/clip_frac": 0.2, "time/rollout": 1.0 + 0.1 * s,
              "time/train": 0.5} for s in (1, 2, 3, 4)]
    steps[0]["time/rollout"] = 60.0  # warm-up
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    _, fig = plot_run(tmp_path)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert "eval (held-out)" not in axes  # no eval records: no eval panel
    assert axes["seconds per phase"].get_ylim() == pytest.approx((0, HEADROOM * 1.4))
    assert "60.00 s (off scale)" in axes["seconds per phase"].texts[0].get_text()
    assert [ln.get_label() for ln in axes["KL"].get_lines()] == ["kl"]
    assert [ln.get_label() for ln in axes["clip fraction"].get_lines()] == ["clip fraction"]
    assert axes["KL"].get_ylim()[1] < 0.01  # not flattened by clip fraction's 0.2


def test_areno_plot_command(tmp_path, capsys):
    from areno.cli import main

    run = tmp_path / "run"
    run.mkdir()
    assert main(["plot", str(run)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    lines = [{"step": s, "reward/mean": 0.1 * s, "response/len_mean": 2.0, "response/len_max": 3.0,
              "train/kl": 0.0, "train/clip_frac": 0.0, "time/rollout": 1.0} for s in (1, 2, 3, 4)]
    # an eval record, and a last line cut short by a kill: neither is a step
    text = "".join(json.dumps(r) + "\n" for r in [{"step": 0, "eval/pass@1": 0.0}, *lines])
    (run / "metrics.jsonl").write_text(text + '{"step": 5, "rew')
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "metrics.png")
    assert (run / "metrics.png").stat().st_size > 10_000
