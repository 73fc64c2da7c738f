"""The benchmark scripts run, write complete results, and compare like with like.

bench_materialize.py times a list-based reference against areno's array path;
the ratios only mean something if both compute the same thing, so the script
checks equal outputs on every workload, and these tests check that check too.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import random_batch, random_rewards

from areno.advantages import group_advantages
from arenobench.lib import child_env
from areno.pack import build_padded_pack, build_train_pack
from areno.split import build_split_pack

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_materialize.py"

WORKLOADS = (
    "advantages", "pack_small", "pack_large", "split_small", "split_large",
    "padded_small", "padded_large", "stats", "e2e_small", "e2e_large",
)


@pytest.fixture(scope="module")
def bm():
    """The materialize benchmark's module (scripts/bench_materialize.py runs its main)."""
    import arenobench.materialize

    return arenobench.materialize


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_writes_every_workload(tmp_path: Path):
    out = tmp_path / "sub" / "materialize.json"  # parent does not exist yet
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "targets:" in proc.stdout
    data = json.loads(out.read_text())
    assert not list(out.parent.glob("*.tmp")), "temp file left beside the output"

    assert data["equality_failures"] == []
    assert data["meta"]["quick"] is True and data["meta"]["repeats"] == 1
    assert set(WORKLOADS) <= set(data["workloads"])
    for name in WORKLOADS:
        w = data["workloads"][name]
        assert w["outputs_equal"] is True, name
        assert _positive_finite(w["units"]), name
        for path in ("reference", "areno"):
            assert _positive_finite(w[path]["median_s"]), (name, path)
            assert len(w[path]["times_s"]) == 1
            assert all(_positive_finite(t) for t in w[path]["times_s"]), (name, path)
        for key in ("ratio", "ratio_of_mins", "reference_us_per_unit", "areno_us_per_unit"):
            assert _positive_finite(w[key]), (name, key)
    for name in ("pack_small", "pack_large"):
        w = data["workloads"][name]
        assert _positive_finite(w["memcpy"]["median_s"]) and _positive_finite(w["fresh_copy"]["median_s"])
        assert _positive_finite(w["areno_over_memcpy"])
        assert w["pack_token_bytes"] == 25 * w["pack_tokens"]  # 4+4+4+1+4+4+4 bytes per position
    for name in ("e2e_small", "e2e_large"):
        comp = data["workloads"][name]["areno_components_median_s"]
        assert all(_positive_finite(comp[k]) for k in ("decode", "advantages", "pack", "non_decode"))
    targets = {t["target"]: t for t in data["targets"]}
    assert len(targets) == 8
    assert all(isinstance(t["pass"], bool) and math.isfinite(t["value"]) for t in targets.values())


def test_bad_flag_is_one_line_error(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0", "--out", str(tmp_path / "x.json")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=child_env(),
    )
    assert proc.returncode == 2
    assert "--repeats" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("seed", range(6))
def test_list_reference_equals_areno(bm, seed: int):
    """Varied group sizes, 1-token prompts and responses, empty responses."""
    batch = random_batch(seed, num_prompts=7, max_prompt=5, max_response=8, min_response=0)
    rewards = random_rewards(batch, seed).astype(np.float64)
    lr = bm.to_lists(batch, rewards)

    adv = group_advantages(rewards, batch.group_index, num_groups=batch.num_prompts)
    assert bm.compare_advantages(bm.ref_advantages(lr.rewards, lr.group_of), adv) == []

    adv_l = adv.tolist()
    assert bm.compare_pack(bm.ref_pack(lr, adv_l), build_train_pack(batch, adv)) == []
    for ws, max_tokens in ((2, 8), (3, 1000)):
        sp = build_split_pack(batch, adv, world_size=ws, max_tokens=max_tokens)
        assert bm.compare_split(bm.ref_split_pack(lr, adv_l, ws, max_tokens), sp) == []
    assert bm.compare_padded(bm.ref_padded(lr, adv_l), build_padded_pack(batch, adv, pad_id=bm.PAD_ID)) == []
    assert bm.compare_stats(bm.ref_stats(lr.logprobs), bm.areno_stats(batch)) == []


def test_make_data_is_well_formed(bm):
    d = bm.make_data(0, 5, 3, (1, 4), (1, 9), (3, 50), empty_every=4)
    b = d.batch
    assert b.num_prompts == 5 and b.num_responses == 15
    assert (b.response_lengths[::4] == 0).all()
    assert b.response_ids.min() >= 3 and b.response_ids.max() < 50
    assert d.lists.responses[1] == b.response_tokens(1).tolist()
    assert d.lists.prompts[2] == b.prompt_tokens(2).tolist()


def test_comparisons_catch_differences(bm):
    """The equality checks are not vacuous: a one-element change is reported."""
    batch = random_batch(3, num_prompts=4, min_response=1)
    rewards = random_rewards(batch, 3).astype(np.float64)
    lr = bm.to_lists(batch, rewards)
    adv = group_advantages(rewards, batch.group_index, num_groups=batch.num_prompts)
    pack = build_train_pack(batch, adv)
    for field in ("input_ids", "targets", "loss_mask", "old_logprobs", "advantages", "position_ids", "seq_index"):
        ref = bm.ref_pack(lr, adv.tolist())
        t = ref[field]
        t[-1] = (~t[-1]) if t.dtype == torch.bool else t[-1] + 1
        errors = bm.compare_pack(ref, pack)
        assert errors and errors[0].startswith(field), (field, errors)
    ref = bm.ref_pack(lr, adv.tolist())
    ref["old_logprobs"] = ref["old_logprobs"].double()
    assert any("dtype" in e for e in bm.compare_pack(ref, pack))

    bad_adv = adv.copy()
    bad_adv[0] += 0.5
    assert bm.compare_advantages(bm.ref_advantages(lr.rewards, lr.group_of), bad_adv)

    stats = bm.areno_stats(batch)
    stats.mean += 1e-3
    assert bm.compare_stats(bm.ref_stats(lr.logprobs), stats)


# -- bench_train.py ------------------------------------------------------------
def test_bench_train_smoke_reports_both_trainers(tmp_path: Path):
    """CPU smoke of scripts/bench_train.py: areno's backend and the padded loop
    each train timed steps on the same batch; the JSON has what the table shows."""
    out = tmp_path / "train.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_train.py"), "--smoke", "--threads", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio areno/padded" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["kind"] == "smoke" and data["meta"]["seqs"] == 8
    for name in ("areno", "padded"):
        r = data[name]
        assert len(r["times_s"]) == 1 and _positive_finite(r["tokens_per_s"]), name
        assert _positive_finite(r["warmup_s"]) and _positive_finite(r["peak_mem_gb"]), name
        assert r["mfu"] is None  # CPU
    assert _positive_finite(data["ratio"]) and 0 < data["padded_fill"] < 1
    assert data["areno_perf"]["perf/train_tokens_per_s"] > 0


VS_TRL = REPO / "scripts" / "bench_demo_vs_trl.py"


@pytest.mark.bench
@pytest.mark.skipif(importlib.util.find_spec("trl") is not None,
                    reason="trl is installed: this covers the run without it")
def test_demo_vs_trl_without_trl_runs_areno_alone(tmp_path: Path):
    """No trl: the install hint, then areno's demo alone (and with a --variant's
    flags: one thread, not vLLM, whose start-up would double the test), with its
    rows in the table and JSON."""
    out = tmp_path / "vs_trl.json"
    env = child_env()
    proc = subprocess.run(
        [sys.executable, str(VS_TRL), "--steps", "3", "--variant", "areno-1t=--cpu-threads 1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trl is not importable" in proc.stdout and "--target /tmp/trlsite trl==1.16.0" in proc.stdout
    assert "areno   " in proc.stdout and "areno-1t " in proc.stdout and "\ntrl " not in proc.stdout
    data = json.loads(out.read_text())
    assert data["trl"] is False and data["ratios"] == {}
    assert [r["trainer"] for r in data["rows"]] == ["areno", "areno-1t"]
    for row in data["rows"]:
        assert row["steps"] == 3
        assert _positive_finite(row["wall_s"]) and 0.0 <= row["final_reward"] <= 1.0
        assert row["s_per_step"] is None and row["to_target_step"] is None  # too few steps for either

    proc = subprocess.run(  # --require-trl: nothing runs
        [sys.executable, str(VS_TRL), "--steps", "3", "--require-trl"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode == 2 and "trl is not importable" in proc.stdout
    assert not re.search(r"^areno\b", proc.stdout, re.M)  # no areno run started


@pytest.mark.bench
def test_bench_ratio_noise_smoke_takes_step_1_from_both_sources(tmp_path):
    """scripts/bench_ratio_noise.py --smoke (the demo model, bf16 on CPU): the
    trainer's old log-probs give a ratio of exactly 1 at step 1, the sampler's a
    spread, and both runs see the same sampler/trainer mismatch."""
    out = tmp_path / "ratio.json"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_ratio_noise.py"), "--smoke",
                          "--engine", "hf", "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env(REPO))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    step1 = json.loads(out.read_text())["step1"]
    assert (step1["trainer"]["train/ratio_std"], step1["trainer"]["train/ratio_max"]) == (0.0, 1.0)
    assert step1["sampler"]["train/ratio_std"] > 0 and step1["sampler"]["train/tis_weight"] == 1.0
    assert step1["sampler"]["train/logprob_diff"] == step1["trainer"]["train/logprob_diff"] > 0


@pytest.mark.bench
def test_bench_lora_vs_full_runs_both_arms_on_one_seed(tmp_path: Path, tiny_chat_path: Path):
    """scripts/bench_lora_vs_full.py (issue 26, 3) on the tiny chat model, 2 steps:
    both arms run as `areno train` and their reward curves land in the JSON."""
    out = tmp_path / "lvf.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_lora_vs_full.py"), "--model", str(tiny_chat_path),
         "--steps", "2", "--batch-size", "2", "--n-samples", "2", "--window", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env(REPO))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["full FT", "LoRA r=8"] and arms["LoRA r=8"]["lr"] == 10 * arms["full FT"]["lr"]
    assert all(len(a["rewards"]) == 2 and 0 <= a["summary"]["best"] <= 1 for a in arms.values())
    assert "mean reward/mean per block" in res.stdout


@pytest.mark.bench
def test_bench_partial_learning_runs_k0_and_partial_in_split_placement(tmp_path: Path, tiny_chat_path: Path):
    """scripts/bench_partial_learning.py (issue 39's real-model learning check) on
    the tiny chat model, 3 steps, the transformers engine: both arms run in an
    engine process, K = 0 trains every token at lag 0, the partial arm at K = 2
    trains tokens of older versions (its start-up rounds share version 0)."""
    out = tmp_path / "pl.json"
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_partial_learning.py"), "--model", str(tiny_chat_path),
         "--steps", "3", "--batch-size", "2", "--n-samples", "2", "--window", "2", "--engine", "hf",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=child_env(REPO))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["K=0 s0", "K=2 partial s0"]
    assert all(len(a["rewards"]) == 3 for a in arms.values())
    sync, partial = arms["K=0 s0"]["token_lag"], arms["K=2 partial s0"]["token_lag"]
    assert sync[0] > 0 and sync[1:] == [0, 0] and sum(partial[1:]) > 0
    assert "over 1 seed(s)" in res.stdout


@pytest.mark.parametrize("seed", range(4))
def test_near_limit_references_equal_areno(seed: int):
    """The near-limit references compute exactly what areno computes (1-token
    prompts and responses, empty responses, ragged groups), or their ratio means nothing."""
    from arenobench.listref import compare_advantages, compare_pack, compare_padded
    from arenobench.nearlimit import nl_advantages, nl_pack, nl_padded

    batch = random_batch(seed, num_prompts=7, max_prompt=5, max_response=8, min_response=0)
    rewards = random_rewards(batch, seed).astype(np.float64)
    adv = group_advantages(rewards, batch.group_index, num_groups=batch.num_prompts)
    assert compare_advantages(nl_advantages(rewards, batch.group_index, batch.num_prompts), adv) == []
    assert compare_pack(nl_pack(batch, adv), build_train_pack(batch, adv)) == []
    assert compare_padded(nl_padded(batch, adv, 3), build_padded_pack(batch, adv, pad_id=3)) == []


def test_ref_runs_both_trees_and_prints_the_ratio(tmp_path: Path):
    """--ref HEAD: HEAD's benchmark (a git worktree) and this checkout's, each
    once, and per workload this checkout's time over HEAD's."""
    out = tmp_path / "ref.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--repeats", "1", "--ref", "HEAD", "--ref-rounds", "1",
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, env=child_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) .* ([\d.]+)x$", proc.stdout, re.M)}
    assert {"advantages", "pack_small", "padded_large", "e2e_large"} <= set(rows), proc.stdout
    assert all(0.02 < r < 50 for r in rows.values()), rows  # the same code, run twice: near 1 on a quiet host
    data = json.loads(out.read_text())
    assert data["ref"] == head and sorted(data["runs"]) == sorted([head, "."])
    assert all(len(runs) == 1 for runs in data["runs"].values())
    listed = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert "areno-materialize-ref-" not in listed  # the worktree is gone
