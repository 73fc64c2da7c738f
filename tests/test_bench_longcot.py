"""scripts/bench_longcot.py --quick: the real loop (controller, reward workers, 2
CPU ranks) with the synthetic engine runs end to end, writes JSON with every
field finite, and overlapped rewards give identical advantages and packs; its
K = 1 mode (one engine process running the synthetic engine, one step ahead)
reports the rollout in flight and the controller's work hidden behind it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arenobench.lib import child_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_longcot.py"

STEP_FIELDS = (
    "critical_s", "crit_decode_s", "crit_reward_s", "crit_advantages_s", "crit_pack_s", "crit_merge_s",
    "crit_handoff_s", "crit_other_s", "crit_cpu_s", "decode_total_s", "gen_time_s", "handoff_write_s",
    "handoff_ready_s", "first_wait_s", "rank_arrival_skew_s", "rank_prep_s", "readbacks", "opt_steps",
    "readbacks_per_opt_step", "train_s", "rank_train_s", "export_s", "host_outside_s", "step_s",
    "rss_peak_mb", "rss_growth_mb", "loadavg_1m", "pack_tokens",
)
MODES = ("areno_overlap_free", "reference_free", "areno_plain_free", "areno_overlap_5ms",
         "areno_plain_5ms", "areno_async_free")
ASYNC_FIELDS = ("take_s", "wait_batch_s", "wait_weights_s", "host_margin_s", "step_margin_s", "busy_s",
                "step_metric_s", "stream_parts", "period_s", "bench_gap_s", "stream_margin_s",
                "stream_after_last_s", "stream_decode_total_s")


@pytest.mark.timing
def test_bench_longcot_quick(tmp_path: Path) -> None:
    out = tmp_path / "longcot.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=170, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    from arenobench.lib import check_finite

    assert check_finite(data) == []
    assert data["meta"]["quick"] is True and data["meta"]["world_size"] == 2
    for mode in MODES:
        med = data["modes"][mode]["median"]
        missing = [f for f in STEP_FIELDS if f not in med]
        assert not missing, (mode, missing)
        steps = data["modes"][mode]["steps"]
        assert steps and all(f in s for s in steps for f in STEP_FIELDS)
        assert med["critical_s"] > 0 and med["gen_time_s"] > 0 and med["opt_steps"] >= 1
        assert med["readbacks_per_opt_step"] == 1.0, data["modes"][mode]["median"]
    assert data["modes"]["reference_free"]["median"]["pickle_s"] > 0
    # K = 1: the rollout in flight is the engine process's (the same modelled
    # generation as the controller's engine), the host work is hidden behind it
    # and the ranks do not wait for the batch; the warm-up step did wait (its
    # rollout had nothing to hide behind).
    k1, warm = data["modes"]["areno_async_free"], data["warmup"]["areno_async_free"]
    gen = data["modes"]["areno_overlap_free"]["median"]["gen_time_s"]
    for s in k1["steps"]:
        assert all(f in s for f in ASYNC_FIELDS), s
        assert s["gen_time_s"] == pytest.approx(gen, abs=0.02), (s["gen_time_s"], gen)
        assert s["stream_parts"] == 4 and s["pack_tokens"] == data["modes"]["areno_overlap_free"]["median"][
            "pack_tokens"]
        assert 0 < s["critical_s"] < s["gen_time_s"] and s["host_margin_s"] > 0 and s["hidden"] is True
        # the publish ends after the hand-off: by the train and publish at least
        assert s["host_margin_s"] - s["step_margin_s"] >= s["train_s"] + s["export_s"] - 0.01
        assert s["wait_batch_s"] < 0.1 and s["busy_s"] > 0 and isinstance(s["step_hidden"], bool)
        # issue 27, 2: the step's own parts were decoded as they streamed in, all but the
        # last before its last completion came (parts sent only at the end: one decode)
        assert s["stream_parts_scored"] == s["parts_generated"] == 4 and s["streamed"] is True, s
    assert warm["wait_batch_s"] >= 0.25 and warm["step"] == 1 and [s["step"] for s in k1["steps"]] == [2]
    checks = data["checks"]
    for name in ("identical:areno_overlap_free==areno_plain_free",
                 "identical:areno_overlap_5ms==areno_plain_5ms",
                 "reference_equals_areno (advantages to 1e-5)"):
        assert checks[name]["pass"], (name, checks[name])
    hidden = [n for n in checks if n.startswith("hidden (K=1)")]
    assert len(hidden) == 2 and checks[hidden[0]]["pass"], checks
    (streamed,) = [n for n in checks if n.startswith("streamed (K=1)")]
    assert checks[streamed]["pass"], checks[streamed]
    assert all(c["pass"] for c in checks.values() if c.get("required", True)), checks
    names = {t["target"] for t in data["targets"]}
    assert any("critical reward time" in n for n in names) and any("readbacks" in n for n in names)
    assert any(n.startswith("K=1") for n in names)
    assert "host critical path (end of generation -> hand-off written)" in proc.stdout
    assert "K = 1 (--rollout-world-size 1" in proc.stdout



def test_union_in() -> None:
    from arenobench.lib import union_in

    assert union_in([], 0, 1) == 0
    assert union_in([(0, 2), (1, 3), (5, 6)], 0.5, 5.5) == pytest.approx(3.0)
    assert union_in([(0, 1), (0.2, 0.4)], 0, 10) == pytest.approx(1.0)


def test_cpu_in_counts_outermost_spans_prorated() -> None:
    from arenobench.lib import cpu_in

    spans = [("reward", 0.2, 0.4, 0.1), ("decode", 0.0, 1.0, 0.8), ("pack", 2.0, 4.0, 1.0), ("other", 0, 9, 9)]
    # reward is nested in decode (not counted twice); pack is half inside [0, 3]
    assert cpu_in(spans, ("decode", "reward", "pack"), 0.0, 3.0) == pytest.approx(0.8 + 0.5)


def test_readback_counter_sees_item_tolist_cpu_with_sites() -> None:
    import torch
    from arenobench.lib import ReadbackCounter

    x = torch.arange(3.0)
    with ReadbackCounter() as counter:
        x.sum().item()
        x.tolist()
        x.numpy()  # a CPU view, not a readback
        x.cpu()
    name = Path(__file__).name
    assert [c.split("@")[0] for c in counter.calls] == ["item", "tolist", "cpu"]
    assert all(c.split("@")[1].startswith(name + ":") for c in counter.calls), counter.calls
    x.sum().item()  # after the mode exits nothing is seen
    assert len(counter.calls) == 3


def test_rank_pack_record_sees_every_field_and_the_advantages() -> None:
    """The ranks' digests cover every field of their share, and the per-sequence
    advantages are the per-sample ones, in the share's order."""
    from helpers import random_batch
    from arenobench.longcot.ranks import pack_record

    from areno.backend.handoff import LocalPack, PackWriter
    from areno.split import build_split_pack

    b = random_batch(seed=2, num_prompts=6, max_response=12, min_response=1)
    adv = np.random.default_rng(2).standard_normal(b.num_responses).astype(np.float32)
    split = build_split_pack(b, adv, world_size=2, max_tokens=32)
    writer = PackWriter()
    try:
        recs = [pack_record(LocalPack(h)) for h in writer.write(split)]
        changed = adv.copy()
        changed[int(split.pack.sample_index[0])] += 1.0  # rank 0's first sequence
        (h0, _) = writer.write(build_split_pack(b, changed, world_size=2, max_tokens=32))
        other = pack_record(LocalPack(h0))
    finally:
        writer.close()
    for r, rec in enumerate(recs):
        assert len(rec["digests"]) == 11  # 10 TrainPack fields + the micro-batch plan
        s0, s1 = split.rank_seq_range(r)
        np.testing.assert_allclose(rec["seq_adv"], adv[split.pack.sample_index[s0:s1].numpy()], rtol=1e-6)
    assert sum(rec["pack_tokens"] for rec in recs) == split.pack.num_tokens
    assert {k for k, v in other["digests"].items() if v != recs[0]["digests"][k]} == {"advantages"}
    assert other["seq_adv"][0] == pytest.approx(recs[0]["seq_adv"][0] + 1.0)


def test_identity_checks_catch_a_changed_field() -> None:
    from arenobench.longcot.report import identity_checks
    from arenobench.longcot.run import MODES

    def row(step, adv=0.5, ids="a"):
        return {"step": step, "_digests": {"rank0.input_ids": ids, "rank0.advantages": str(adv)},
                "_seq_adv": [adv]}

    same = {m: [row(1)] for m in MODES}
    assert all(c["pass"] for c in identity_checks(same, 1).values())
    rows = {**same, "areno_plain_free": [row(1, ids="b")], "reference_free": [row(1, adv=0.5 + 1e-7)]}
    checks = identity_checks(rows, 1)
    bad = checks["identical:areno_overlap_free==areno_plain_free"]
    assert not bad["pass"] and bad["differences"] == [{"round": 1, "fields": ["rank0.input_ids"]}]
    ref = checks["reference_equals_areno (advantages to 1e-5)"]  # ids differ; advantages agree to 1e-5
    assert not ref["pass"] and ref["differences"][0]["fields"] == ["rank0.input_ids"]
    rows["reference_free"] = [row(1, adv=0.6, ids="b")]
    ref = identity_checks(rows, 1)["reference_equals_areno (advantages to 1e-5)"]
    assert ref["differences"][0]["fields"] == ["per-sequence advantages (beyond 1e-5)"]


def test_hidden_checks_need_every_step_before_the_rollout_in_flight() -> None:
    from arenobench.longcot.report import HIDDEN_SLACK_S, hidden_checks

    def row(step, host, upd, streamed=True):
        return {"step": step, "host_margin_s": host, "step_margin_s": upd, "streamed": streamed,
                "stream_parts_scored": 4 if streamed else 1, "stream_margin_s": 0.01 if streamed else float("nan")}

    rows = [row(2, 1.0, 0.5), row(3, 0.2, -HIDDEN_SLACK_S / 2)]  # within the slack
    streamed, host, full = hidden_checks(rows, 2, quick=False).values()
    assert streamed["pass"] and host["pass"] and full["pass"] and full["required"]
    rows.append(row(4, -2 * HIDDEN_SLACK_S, -1.0, streamed=False))  # its parts all came at the end
    streamed, host, full = hidden_checks(rows, 3, quick=True).values()
    assert not streamed["pass"] and [d["round"] for d in streamed["differences"]] == [4]
    assert not host["pass"] and [d["round"] for d in host["differences"]] == [4]
    assert not full["pass"] and full["required"] is False  # --quick: info only
    _, short, _ = hidden_checks(rows[:1], 2, quick=False).values()
    assert not short["pass"]  # a measured step missing


class _Prompts:
    def __init__(self, lengths, seed=0):
        rng = np.random.default_rng(seed)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.ids = rng.integers(3, 50, int(self.offsets[-1])).astype(np.int32)

    def __len__(self):
        return self.offsets.size - 1


def test_synthetic_engine_stream_equals_generate() -> None:
    from helpers import concat, take_prompts

    prompts = _Prompts([3, 5, 2, 7, 4, 6, 3])
    from arenobench.longcot.sim import SyntheticEngine

    eng = SyntheticEngine(n=3, resp_len=20, max_new_tokens=30, vocab=(3, 100), gen_time_s=0.0, seed=1)
    total = eng.prepare(prompts)
    assert total == 7 * 3 * 20
    order = np.array([4, 0, 6, 2, 1, 5, 3])
    lens = np.diff(prompts.offsets)[order]
    ids = np.concatenate([prompts.ids[prompts.offsets[p]:prompts.offsets[p + 1]] for p in order])
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    whole = eng.generate(ids, offsets, 3, None)
    assert whole.num_responses == 21 and int(whole.response_lengths.max()) <= 30
    assert np.all((whole.response_ids >= 3) & (whole.response_ids < 100))
    parts = list(eng.generate_stream(ids, offsets, 3, None, min_groups=3))
    assert [p.size for p, _ in parts] == [3, 3, 1]
    finish = [max(eng.blocks[k].finish_s for k in [ids[offsets[q]:offsets[q + 1]].tobytes() for q in p])
              for p, _ in parts]
    assert finish == sorted(finish)  # parts come in finishing order
    pos = np.concatenate([p for p, _ in parts])
    got, _ = take_prompts(concat([b for _, b in parts]), np.argsort(pos))
    for f in ("prompt_ids", "prompt_offsets", "response_ids", "response_offsets", "response_logprobs",
              "group_index", "finish_reason"):
        np.testing.assert_array_equal(getattr(got, f), getattr(whole, f), err_msg=f)
    lists, finish_l = eng.generate_lists(ids, offsets, 3)
    assert [x for r in lists.responses for x in r] == whole.response_ids.tolist()
    assert finish_l == whole.finish_reason.tolist() and lists.group_of == whole.group_index.tolist()
