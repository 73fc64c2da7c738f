"""The reading of bench_longcot's results: the medians over the rounds, the
checks (packs identical between modes, K = 1's host work hidden behind the
rollout in flight), pass/fail targets over the modes' rounds, and the printed
report (two tables of per-mode medians, the K = 1 mode's table by step, the
targets and the checks). Ratios are medians of same-round ratios: the two steps
of a round ran minutes apart at most, under the same load.
"""

from __future__ import annotations

import numpy as np
from arenobench.lib import table, target, target_lines

HIDDEN_SLACK_S = 0.05  # scheduling noise of a loaded 2-core host
# (a, b): advantages and pack must be identical between modes a and b, same round.
IDENTICAL = (("areno_overlap_free", "areno_plain_free"), ("areno_overlap_5ms", "areno_plain_5ms"))


def paired_ratio(out: dict, num: str, den: str, key_num: str, key_den: str | None = None) -> float:
    """Median over rounds of steps[num][key_num] / steps[den][key_den] (same round,
    so the two steps ran minutes apart at most under the same load)."""
    rows_n, rows_d = out["modes"][num]["steps"], out["modes"][den]["steps"]
    ratios = [rn[key_num] / rd[key_den or key_num] for rn, rd in zip(rows_n, rows_d) if rd[key_den or key_num] > 0]
    return float(np.median(ratios)) if ratios else float("nan")


def evaluate_targets(out: dict) -> list[dict]:
    a = out["modes"]["areno_overlap_free"]["median"]
    waits = [s["first_wait_s"] for v in out["modes"].values() for s in v["steps"]]
    base = [s["collective_baseline_s"] for v in out["modes"].values() for s in v["steps"]]
    return [
        target("host critical path, areno (overlap, free reward) [s]", a["critical_s"], "<=", 0.5, note=""),
        target("reference / areno host critical path",
               paired_ratio(out, "reference_free", "areno_overlap_free", "critical_s"), ">=", 20.0,
               note="reference hands off by the same shm write (conservative)"),
        target("hand-off ready (last rank mapped) [s]", a["handoff_ready_s"], "<=", 0.05, note=""),
        target("first rank's wait at the first collective, all steps [s]", float(np.median(waits)), "<=", 0.01,
               note=f"'near 0': <= 10 ms; median of {len(waits)} steps (every mode uses the same shm hand-off); "
                    f"p90 {np.percentile(waits, 90) * 1e3:.1f} ms; the same collective right after: median "
                    f"{np.median(base) * 1e3:.1f} ms"),
        target("device-to-host readbacks per optimizer step", a["readbacks_per_opt_step"], "==", 1.0, note=""),
        target("critical reward time, overlap / no overlap (R ms reward)",
               paired_ratio(out, "areno_overlap_5ms", "areno_plain_5ms", "crit_reward_s"), "<=", 0.10, note=""),
        # informational
        target("reference with pickled hand-off / areno host critical path",
               paired_ratio(out, "reference_free", "areno_overlap_free", "critical_pickled_s", "critical_s"),
               ">=", 20.0, note="info: the reference's shm write replaced by pickling its nested lists"),
        target("reference / areno critical-path CPU time (main thread)",
               paired_ratio(out, "reference_free", "areno_overlap_free", "crit_cpu_s"), ">=", 20.0,
               note="info: load-insensitive; excludes the hand-off write"),
    ] + async_targets(out)


def async_targets(out: dict) -> list[dict]:
    """K = 1 (when run): the controller's work hidden behind the rollout in flight."""
    k1 = out["modes"].get("areno_async_free")
    if not k1:
        return []
    a, s = k1["median"], out["modes"]["areno_overlap_free"]["median"]
    margins = [r["host_margin_s"] for r in k1["steps"]]
    return [
        target("K=1: host work ends before the rollout in flight, min margin [s]", min(margins), ">=", 0.0,
               note=f"median {np.median(margins) * 1e3:.0f} ms; host work {a['critical_s'] * 1e3:.1f} ms median"),
        target("K=1: engine idle before its rollout (time/wait_weights), max [s]",
               max(r["wait_weights_s"] for r in k1["steps"]), "<=", 0.05,
               note="the engine never waits for the controller: the step is generation's"),
        target("K=1 step / synchronous step (overlap, free)", a["step_s"] / s["step_s"], "<=", 1.0,
               note=f"info: {a['step_s']:.2f} s vs {s['step_s']:.2f} s; generation {a['gen_time_s']:.2f} s; "
                    f"period (step start to step start, the bench's work between steps included) "
                    f"{a['period_s']:.2f} s"),
    ]


# -- report --------------------------------------------------------------------------
CRIT_COLS = [("critical", "critical_s"), ("decode", "crit_decode_s"), ("reward", "crit_reward_s"),
             ("adv", "crit_advantages_s"), ("pack", "crit_pack_s"), ("merge", "crit_merge_s"),
             ("handoff", "crit_handoff_s"), ("other", "crit_other_s"), ("cpu", "crit_cpu_s")]
# (title, key, scale, format): ms unless marked
OTHER_COLS = [
    ("h-write", "handoff_write_s", 1e3, "7.1f"), ("h-ready", "handoff_ready_s", 1e3, "7.1f"),
    ("1st-wait", "first_wait_s", 1e3, "8.2f"), ("base", "collective_baseline_s", 1e3, "5.1f"),
    ("skew", "rank_arrival_skew_s", 1e3, "6.1f"), ("prep", "rank_prep_s", 1e3, "6.1f"),
    ("p-cpu", "rank_prep_cpu_s", 1e3, "6.1f"), ("rb/opt", "readbacks_per_opt_step", 1, "6.2f"),
    ("RSS MB", "rss_peak_mb", 1, "7.0f"), ("+MB", "rss_growth_mb", 1, "5.0f"), ("gen s", "gen_time_s", 1, "5.1f"),
    ("late", "rollout_late_s", 1e3, "6.1f"), ("train s", "train_s", 1, "7.1f"), ("export", "export_s", 1, "6.2f"),
    ("outside", "host_outside_s", 1e3, "7.1f"), ("step s", "step_s", 1, "6.1f"), ("load", "loadavg_1m", 1, "5.1f"),
]


ASYNC_COLS = [  # (title, key, scale, format) of a K = 1 step
    ("gen k+1 s", "gen_time_s", 1, "9.2f"), ("take", "take_s", 1e3, "6.1f"), ("host", "critical_s", 1e3, "6.1f"),
    ("train s", "train_s", 1, "7.2f"), ("publish", "export_s", 1e3, "7.1f"),
    ("w-batch", "wait_batch_s", 1e3, "7.1f"), ("w-weights", "wait_weights_s", 1e3, "9.1f"),
    ("host-margin", "host_margin_s", 1e3, "11.1f"), ("step-margin", "step_margin_s", 1e3, "11.1f"),
    ("step s", "step_s", 1, "6.2f"), ("period s", "period_s", 1, "8.2f"), ("hidden", "hidden", 1, "6.0f"),
    ("+update", "step_hidden", 1, "7.0f"),
    ("parts", "stream_parts_scored", 1, "5.0f"), ("str-margin", "stream_margin_s", 1e3, "10.1f"),
    ("after-last", "stream_after_last_s", 1e3, "10.1f"), ("streamed", "streamed", 1, "8.0f"),
]


def async_lines(out: dict) -> list[str]:
    """The K = 1 table: one line per step (warm-up first), then the median."""
    k1 = out["modes"].get("areno_async_free")
    if not k1:
        return []
    sync = out["modes"]["areno_overlap_free"]["median"]["step_s"]
    lines = ["K = 1 (--rollout-world-size 1 --off-policy-steps 1: the engine process generates step k+1 while the "
             "controller scores, packs and hands off step k and the ranks train it), ms unless marked: generation "
             "of the rollout in flight (k+1), take (collect k + send k+1), the controller's critical work on k "
             "(the batch whole -> hand-off written: what is left of decode and reward, adv, pack, hand-off), train, publish (weights "
             "k for rollout k+2), time/wait_batch, time/wait_weights (the engine idle before its rollout), "
             "margins = end of k+1's generation - end of the host work / of the publish, step wall "
             "(train_step), period (step start to the next step's: the bench's gc and probe reading "
             "between steps included, the engine generating meanwhile); hidden = "
             f"host-margin >= -50 ms (1 = yes), +update: step-margin too; parts: step k's parts decoded as "
             "they streamed in, str-margin: k's last completion minus the end of the decode of every part "
             "before the last, after-last: decode left after it (the last part's), streamed: str-margin >= "
             "-50 ms. The synchronous step (overlap, free) "
             f"takes {sync:.2f} s."]
    rows = [("warm-up", out["warmup"]["areno_async_free"])] + [(f"step {r['step']}", r) for r in k1["steps"]]
    rows = [(n, {"period_s": float("nan"), **r}) for n, r in rows]
    rows.append(("median", {**k1["median"], **{k: float(all(r[k] for r in k1["steps"]))
                                               for k in ("hidden", "step_hidden", "streamed")}}))
    lines += table("K = 1", 9, [(t, spec) for t, _, _, spec in ASYNC_COLS],
                   [(n, [float(r[k]) * sc for _, k, sc, _ in ASYNC_COLS]) for n, r in rows])
    med = k1["median"]
    lines += [f"K = 1 step {med['step_s']:.2f} s (period {med['period_s']:.2f} s) vs synchronous {sync:.2f} s "
              f"({med['step_s'] / sync:.2f}x); "
              f"ideal max(generation {med['gen_time_s']:.2f} s, host + train + publish "
              f"{med['critical_s'] + med['train_s'] + med['export_s']:.2f} s)", ""]
    return lines


def format_report(out: dict) -> str:
    modes = out["modes"].values()
    w = max(len(v["label"]) for v in modes) + 1
    lines = ["host critical path (end of generation -> hand-off written) by phase, ms; "
             "cpu = controller main-thread CPU in it (no hand-off)"]
    lines += table("mode", w, [(t, "8.1f") for t, _ in CRIT_COLS],
                   [(v["label"], [v["median"][k] * 1e3 for _, k in CRIT_COLS]) for v in modes])
    lines += ["", "other figures (ms unless marked): hand-off write / ready (last rank mapped), first-collective "
              "wait, the same collective right after (base), rank arrival skew, rank work before it (wall, CPU: map "
              "+ device copies of every micro-batch), readbacks per optimizer step, controller peak RSS in the step "
              "and its growth, simulated generation, host work after generation ended on the stream, train, weight "
              "export, host work outside the window, step wall, load average"]
    lines += table("mode", w, [(t, spec) for t, _, _, spec in OTHER_COLS],
                   [(v["label"], [v["median"][k] * sc for _, k, sc, _ in OTHER_COLS]) for v in modes])
    ref = out["modes"].get("reference_free", {}).get("median")
    if ref:
        lines.append(f"reference: pickling its per-rank nested lists instead of the shm write would cost "
                     f"{ref['pickle_s'] * 1e3:.0f} ms ({ref['pickle_bytes'] / 1e6:.0f} MB) on the controller: "
                     f"critical path {ref['critical_pickled_s'] * 1e3:.0f} ms")
    a, m = out["modes"]["areno_overlap_free"]["median"], out["meta"]
    lines.append(f"areno overlap: decode total (incl. overlapped) {a['decode_total_s'] * 1e3:.0f} ms over "
                 f"{a['stream_parts']:.0f} parts; pack {a['pack_tokens']:,.0f} tokens; train: "
                 f"{m['args']['train_micro'] or 'all'} of {a['micro_batches_per_rank']:.0f} micro-batches "
                 f"per rank per optimizer step ({a['rank_train_s']:.1f} s rank compute)")
    sites = a.get("readback_sites") or []
    lines += [f"readback call sites on the ranks: {', '.join(sites) or 'none'}", ""]
    lines += async_lines(out)
    lines.append("targets (ratios: median over rounds of same-round ratios):"
                 + ("  (quick sizes: not meaningful, shown as n/a)" if m["quick"] else ""))
    lines += target_lines(out["targets"], m["quick"], 62, "10.4g")
    lines.append("checks:")
    for name, c in out["checks"].items():
        verdict = "PASS" if c["pass"] else ("FAIL" if c.get("required", True) else "info")
        lines.append(f"  {verdict}  {name}" + (f"  {c['differences']}" if c["differences"] else ""))
    lines += ["", f"world size {m['world_size']} ({m['strategy']}), {m['response_tokens_per_step']:,} response "
              f"tokens per step, {m['args']['steps']} rounds; load average (1 min) {m['loadavg_start'][0]:.2f} at "
              f"start, {m['loadavg_end'][0]:.2f} at end, {m['cpu_count']} CPUs; controller peak RSS (max over "
              f"steps) {m['controller_lifetime_peak_rss_mb']:.0f} MB; runtime {m['runtime_s']:.0f} s"]
    return "\n".join(lines)


# -- the rounds' figures and checks --------------------------------------------
def summarize(rows: list[dict]) -> dict:
    """Median of every numeric field over the rounds."""
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = float(np.median(np.asarray(vals, dtype=np.float64)))
    return out


def identity_checks(rows: dict[str, list[dict]], steps: int) -> dict:
    """Same-round comparisons of the packs the ranks received (see the docstring)."""
    out: dict = {}

    def differ(ra: dict, rb: dict, skip: str | None = None) -> list[str]:
        return [f for f, h in ra["_digests"].items()
                if rb["_digests"].get(f) != h and not (skip and f.endswith(skip))]

    for a, b in IDENTICAL:
        diffs = [{"round": ra["step"], "fields": d} for ra, rb in zip(rows[a], rows[b]) if (d := differ(ra, rb))]
        out[f"identical:{a}=={b}"] = {"pass": not diffs and len(rows[a]) == steps, "differences": diffs}
    diffs = []
    for ra, rr in zip(rows["areno_plain_free"], rows["reference_free"]):
        d = differ(ra, rr, skip=".advantages")
        if len(ra["_seq_adv"]) != len(rr["_seq_adv"]) or not np.allclose(ra["_seq_adv"], rr["_seq_adv"],
                                                                         rtol=1e-5, atol=1e-5):
            d.append("per-sequence advantages (beyond 1e-5)")
        if d:
            diffs.append({"round": ra["step"], "fields": d})
    out["reference_equals_areno (advantages to 1e-5)"] = {"pass": not diffs, "differences": diffs}
    return out


def hidden_checks(rows: list[dict], steps: int, quick: bool) -> dict:
    """K = 1, over the measured steps: the controller's work on step k (first
    decode -> hand-off written) ends before the rollout in flight (k + 1's)
    finishes generating, to HIDDEN_SLACK_S: the issue's claim. With the update
    (train, publish) too: then the next weights are out before that rollout
    ends, and the engine never waits for them; required at full sizes only (at --quick ones the tiny steps train longer than the 0.3 s
    generation: the step is the ranks', whatever the controller does)."""
    def late(key: str) -> list[dict]:
        return [{"round": r["step"], "host_margin_ms": round(r["host_margin_s"] * 1e3, 1),
                 "step_margin_ms": round(r["step_margin_s"] * 1e3, 1)}
                for r in rows if r[key] < -HIDDEN_SLACK_S]

    slack = f"(+{HIDDEN_SLACK_S * 1e3:.0f} ms)"
    host, step = late("host_margin_s"), late("step_margin_s")
    unstreamed = [{"round": r["step"], "parts_scored": r["stream_parts_scored"],
                   "stream_margin_ms": round(r["stream_margin_s"] * 1e3, 1)} for r in rows if not r["streamed"]]
    return {
        f"streamed (K=1): decode and reward of step k's parts end before its last completion arrives {slack}":
            {"pass": not unstreamed and len(rows) == steps, "differences": unstreamed},
        f"hidden (K=1): host work on step k ends before rollout k+1's generation {slack}":
            {"pass": not host and len(rows) == steps, "differences": host},
        f"hidden (K=1): host work + train + publish of step k end before rollout k+1's generation {slack}":
            {"pass": not step and len(rows) == steps, "differences": step, "required": not quick},
    }
