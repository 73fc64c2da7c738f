"""Shared parts of the benchmark scripts: fixtures, timing,
intervals, process figures, readback counting, tables and JSON output.

Nothing here patches areno; what a benchmark needs from inside the package it
gets through areno's documented hooks (trainer.PhaseTimer spans,
backend/hooks.py RankHooks).
"""

from __future__ import annotations

import gc
import json
import math
import operator
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch.overrides import TorchFunctionMode


# -- CLI and output -------------------------------------------------------------
def child_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """os.environ + extra, with PYTHONPATH led by the checkout that holds this
    arenobench and its scripts/ (then `paths`): a child process (`python -m
    areno.cli`, a script, ranks whose ARENO_RANK_HOOKS name an arenobench module)
    imports the same checkout as its parent, installed or not."""
    scripts = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(scripts.parent), str(scripts), *map(str, paths),
                                         os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


def write_json(path: Path, obj: Any) -> None:
    """Write to a temp file beside `path`, then rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_finite(obj: Any, path: str = "") -> list[str]:
    """JSON paths of every non-finite float in nested dicts and lists."""
    bad = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad += check_finite(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad += check_finite(v, f"{path}[{i}]")
    elif isinstance(obj, float) and not math.isfinite(obj):
        bad.append(path)
    return bad


def table(label: str, label_w: int, cols: list[tuple[str, str]], rows: list[tuple[str, list[float]]]) -> list[str]:
    """Fixed-width lines: header, rule, one line per (label, values). cols:
    (title, format spec such as '8.1f'); the spec's width is the column's."""
    widths = [int(re.match(r"\d+", spec).group()) for _, spec in cols]
    hdr = f"{label:<{label_w}}" + "".join(f" {t:>{w}}" for (t, _), w in zip(cols, widths))
    lines = [hdr, "-" * len(hdr)]
    for name, values in rows:
        lines.append(f"{name:<{label_w}}" + "".join(f" {v:{spec}}" for (_, spec), v in zip(cols, values)))
    return lines


_OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, "==": operator.eq}


def target(name: str, value: float, op: str, threshold: float, **extra: Any) -> dict[str, Any]:
    """One pass/fail target for the JSON: value `op` threshold."""
    return {"target": name, "value": value, "op": op, "threshold": threshold,
            "pass": bool(_OPS[op](value, threshold)), **extra}


def target_lines(targets: list[dict[str, Any]], quick: bool, name_w: int, value_spec: str) -> list[str]:
    """One line per target: PASS/FAIL, or n/a at --quick sizes (too small to mean anything)."""
    lines = []
    for t in targets:
        verdict = "n/a " if quick else ("PASS" if t["pass"] else "FAIL")
        lines.append(f"  {verdict}  {t['target']:<{name_w}} {t['value']:{value_spec}} {t['op']} {t['threshold']:g}"
                     + (f"   ({t['note']})" if t.get("note") else ""))
    return lines


def fmt_k(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else (f"{n / 1e3:.0f}K" if n >= 1e3 else str(n))


# -- the machine ---------------------------------------------------------------
def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [math.nan] * 3


def proc_kb(field: str) -> int:
    """A 'kB' line of /proc/self/status (VmRSS, VmHWM); 0 where there is none."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


def reset_peak_rss() -> bool:
    """Reset VmHWM (and ru_maxrss) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def sleep_until(t: float) -> None:
    """Sleep until time.monotonic() reaches t."""
    left = t - time.monotonic()
    if left > 0:
        time.sleep(left)


# -- timing one function ---------------------------------------------------------
def run_timed(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call: `inner` calls, gc collected before and off during (this
    favours list-heavy code, whose garbage would otherwise trigger collections)."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        dt = time.perf_counter() - t0
    finally:
        gc.enable()
    del out
    return dt / inner


def median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: int, min_run_time: float) -> dict[str, Any]:
    """Round-robin over `fns` (reference, areno, ...): each gets `repeats` timed
    runs, interleaved so that a noisy neighbour hits all of them alike. A run
    shorter than min_run_time averages several calls (calls_per_run)."""
    k = {}
    for name, fn in fns.items():
        t = run_timed(fn, 1)  # also the warm-up call
        k[name] = 1000 if t <= 0 else int(min(1000, max(1, math.ceil(min_run_time / t))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(run_timed(fn, k[name]))
    return {
        name: {"median_s": median(ts), "min_s": float(min(ts)), "times_s": ts, "calls_per_run": k[name]}
        for name, ts in times.items()
    }


class Pairs:
    """Times reference/areno pairs, each after checking that their outputs are equal."""

    def __init__(self, repeats: int, min_run_time: float) -> None:
        self.repeats, self.min_run_time = repeats, min_run_time
        self.results: dict[str, Any] = {}
        self.failures: list[str] = []

    def time(self, name: str, label: str, units: int, unit: str, ref_fn, areno_fn, compare,
             baselines: dict[str, Callable] | None = None, **extra) -> dict[str, Any]:
        errors = compare(ref_fn(), areno_fn())
        self.failures.extend(f"{name}: {e}" for e in errors)
        print(f"  {name:<13} {label:<40}", end="", flush=True)
        t = time_interleaved({"reference": ref_fn, "areno": areno_fn, **(baselines or {})},
                             self.repeats, self.min_run_time)
        ref_m, ar_m, ar_min = t["reference"]["median_s"], t["areno"]["median_s"], t["areno"]["min_s"]
        self.results[name] = res = {
            "label": label, "unit": unit, "units": units, **t,
            "ratio": ref_m / ar_m if ar_m > 0 else float("inf"),
            "ratio_of_mins": t["reference"]["min_s"] / ar_min if ar_min > 0 else float("inf"),
            "reference_us_per_unit": ref_m / units * 1e6, "areno_us_per_unit": ar_m / units * 1e6,
            "outputs_equal": not errors, **extra,
        }
        print(f" ref {ref_m * 1e3:9.3f} ms  areno {ar_m * 1e3:8.3f} ms  x{ref_m / ar_m:7.1f}", flush=True)
        return res


# -- intervals on one clock -------------------------------------------------------
def union_in(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of intervals clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def cpu_in(spans: list[tuple[str, float, float, float]], phases: tuple[str, ...], lo: float, hi: float) -> float:
    """CPU time of the outermost spans (phase, start, end, cpu_s) of `phases`
    inside [lo, hi], prorated for spans that straddle an end (a span nested in
    another of these phases is not counted twice)."""
    ev = [(a, z, c) for p, a, z, c in spans if p in phases]
    top = [(a, z, c) for a, z, c in ev
           if not any(a2 <= a and z <= z2 and (a2, z2) != (a, z) for a2, z2, _ in ev)]
    total = 0.0
    for a, z, c in top:
        inside = min(z, hi) - max(a, lo)
        if inside > 0:
            total += c * inside / max(z - a, 1e-12)
    return total


# -- device-to-host readbacks ------------------------------------------------------
class ReadbackCounter(TorchFunctionMode):
    """Counts Tensor.item/tolist/cpu calls, with their call sites, while active.

    A torch function mode sees every tensor method call without patching
    torch.Tensor (on CPU there is no sync-debug mode to ask instead). Tensor.numpy
    is left out: it cannot read a device tensor (it raises on CUDA), and the ranks
    call it on the CPU pack views, which is no readback. Every torch call made
    under the mode pays a Python dispatch (a few us), so keep it off code whose
    time is being measured."""

    METHODS = frozenset(("item", "tolist", "cpu"))

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.METHODS:
            fr = sys._getframe(1)  # the caller: torch's dispatch adds no Python frame
            self.calls.append(f"{func.__name__}@{os.path.basename(fr.f_code.co_filename)}:{fr.f_lineno}")
        return func(*args, **(kwargs or {}))


# -- fixtures ----------------------------------------------------------------------
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE trained here on a synthetic corpus (no download); the
    first len(SPECIALS) ids are its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1234)
    syll = [a + b for a in "bcdfghklmnprstvwz" for b in "aeiou"] + ["th", "ng", "st", "qu"]
    words = ["".join(rng.choices(syll, k=rng.randint(1, 3))) for _ in range(3000)]
    digits = [str(rng.randrange(1000)) for _ in range(300)]
    vocab_words = words + digits + ["=", "+", "-", "*", "(", ")", ".", ",", "?", "####"]
    lines = [" ".join(rng.choices(vocab_words, k=rng.randint(5, 24))) for _ in range(6000)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )

