"""The real model's step, commit against commit, phase by phase.

Each revision gets a `git worktree` in a temp dir; every run is the real CLI
(`python -m areno.cli train`, PYTHONPATH = that worktree, this interpreter) on
SmolLM2-135M-Instruct (scripts/arenobench/smol.py builds it once into --cache), fp32,
the vLLM CPU engine, --prompts x --samples (8 x 8), 16 new tokens, --steps
seeded steps (3) of a short addition task (~25-token prompts, so vLLM never
chunks a prefill). Per run the median over steps 2.. of each phase's `time/*`
(metrics.jsonl): train, weight_sync, rollout (step 1 holds the warm-ups).

Runs are interleaved: for each repeat, each thread setting, the revisions in
turn, the order flipped every repeat (ABBA...), so a neighbour's load falls on
both alike; the table gives medians over repeats and the ratio new/old of
those medians. A thread setting is a count (`--cpu-threads N`) or `default`
(no flag: each commit's own rule). `--env K=V` is set for every run, `--busy`
runs one pure-Python spin loop alongside each run (a busy neighbour).

    python scripts/bench_step_commits.py                       # 42b2f93 vs HEAD
    python scripts/bench_step_commits.py --revs HEAD --threads 1,2,default --busy
    python scripts/bench_step_commits.py --ref 42b2f93       # this checkout, uncommitted changes too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from arenobench.refs import CURRENT, rev_id, worktrees
from arenobench.refs import label as rev_label

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REVS = ("42b2f93", "HEAD")
PHASES = ("train", "weight_sync", "rollout", "step")
SPIN = "while True: pass"
SYSTEM = "Answer briefly."
REWARD_SRC = (
    "def reward_fn(record):\n"
    "    return float(record.answer in record.completion) - 0.01 * len(record.completion)\n"
)


@dataclass(frozen=True)
class RunSpec:
    """One run: which revision, which thread setting (None: the commit's default)."""

    rev: str
    threads: int | None

    @property
    def threads_label(self) -> str:
        return "default" if self.threads is None else str(self.threads)


def parse_threads(text: str) -> list[int | None]:
    """'2,default' -> [2, None]."""
    out: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        out.append(None if item == "default" else int(item))
    return out


def schedule(revs: Sequence[str], threads: Sequence[int | None], repeats: int) -> list[RunSpec]:
    """Interleaved order: repeat r runs each thread setting for every revision,
    the revisions reversed on odd repeats (A B, B A, ...)."""
    out = []
    for r in range(repeats):
        order = list(revs) if r % 2 == 0 else list(reversed(revs))
        for t in threads:
            out += [RunSpec(rev, t) for rev in order]
    return out


def phase_medians(records: list[dict], skip: int = 1) -> dict[str, float]:
    """metrics.jsonl records -> {phase: median seconds over the step records
    after the first `skip`} (time/<phase>)."""
    steps = [r for r in records if "time/step" in r][skip:]
    return {p: statistics.median(r[f"time/{p}"] for r in steps) for p in PHASES
            if steps and all(f"time/{p}" in r for r in steps)}


def summarize(results: list[tuple[RunSpec, dict[str, float]]], revs: Sequence[str]) -> list[dict]:
    """Rows {threads, phase, <rev>: median over repeats, ..., ratio: last/first}."""
    rows = []
    labels = list(dict.fromkeys(spec.threads_label for spec, _ in results))
    for label in labels:
        for phase in PHASES:
            row: dict = {"threads": label, "phase": phase}
            for rev in revs:
                vals = [m[phase] for s, m in results if s.rev == rev and s.threads_label == label and phase in m]
                row[rev] = statistics.median(vals) if vals else float("nan")
                row[f"n_{rev}"] = len(vals)
            if len(revs) > 1:
                row["ratio"] = row[revs[-1]] / row[revs[0]] if row[revs[0]] else float("nan")
            rows.append(row)
    return rows


def markdown(rows: list[dict], revs: Sequence[str]) -> str:
    """The summary as a markdown table (seconds; ratio = last revision / first)."""
    head = ["threads", "phase", *[f"{rev_label(r)} s" for r in revs]] + (["ratio"] if len(revs) > 1 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = [row["threads"], row["phase"], *[f"{row[r]:.2f}" for r in revs]]
        if len(revs) > 1:
            cells.append(f"{row['ratio']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def task_files(d: Path, prompts: int, steps: int) -> tuple[Path, Path]:
    """An addition task of prompts * steps rows and its reward plugin (exact answer,
    minus a length term, so a group's samples rarely tie)."""
    data, reward = d / "add.jsonl", d / "add_reward.py"
    rows = [(1 + (7 * i) % 50, 1 + (13 * i) % 50) for i in range(prompts * steps)]
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Reply with the number only.",
                                        "answer": str(a + b)}) + "\n" for a, b in rows))
    reward.write_text(REWARD_SRC)
    return data, reward


def train_flags(model: Path, data: Path, reward: Path, args: argparse.Namespace) -> dict[str, str | None]:
    """The run's flags (value None: a bare switch), the same for every revision."""
    return {
        "--ckpt": str(model), "--dataset-path": str(data), "--reward-fn-path": str(reward),
        "--system-prompt": SYSTEM, "--batch-size": str(args.prompts), "--n-samples": str(args.samples),
        "--max-new-tokens": str(args.new_tokens), "--max-steps": str(args.steps), "--seed": "0",
        "--dtype": "float32", "--rollout-engine": "vllm", "--reward-workers": "0",
        "--log-completions": "0", "--no-save": None,
    }


def supported(flags: dict[str, str | None], help_text: str) -> dict[str, str | None]:
    """Only the flags this revision's `train --help` names (an older CLI may lack one)."""
    return {k: v for k, v in flags.items() if k in help_text}


def command(flags: dict[str, str | None], threads: int | None, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "areno.cli", "train", "--output-dir", str(out)]
    for k, v in flags.items():
        argv += [k] if v is None else [k, v]
    return argv + ([] if threads is None else ["--cpu-threads", str(threads)])


def run_one(tree: Path, argv: list[str], env: dict[str, str], busy: bool, out: Path) -> dict[str, float]:
    """One CLI run in `tree` -> phase_medians of its metrics (SystemExit on failure)."""
    spin = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        res = subprocess.run(argv, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree)},
                             capture_output=True, text=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {tree} (rc {res.returncode}):\n{res.stderr[-2000:]}")
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return phase_medians(recs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revs", nargs="+", default=list(DEFAULT_REVS),
                   help=f"old then new (one: no ratio); {CURRENT!r} is this checkout as it is on disk")
    p.add_argument("--ref", metavar="REV", help=f"this checkout against REV: the same as --revs REV {CURRENT}")
    p.add_argument("--threads", type=parse_threads, default=[2, None], help="e.g. 2,default or 1,2,default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--env", action="append", default=[], help="K=V for every run (repeatable)")
    p.add_argument("--busy", action="store_true", help="a spin loop beside every run")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "areno-bench-cache",
                   help="where SmolLM2 is built once")
    p.add_argument("--out", type=Path, help="JSON of every run and the summary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from arenobench.smol import smol_model_path

    model = smol_model_path(args.cache)
    env = dict(kv.split("=", 1) for kv in args.env)
    revs = [rev_id(r) for r in ([args.ref, CURRENT] if args.ref else args.revs)]
    results: list[tuple[RunSpec, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="areno-step-commits-") as d, worktrees(revs, Path(d)) as trees:
        data, reward = task_files(Path(d), args.prompts, args.steps)
        base = train_flags(model, data, reward, args)
        helps = {rev: subprocess.run([sys.executable, "-m", "areno.cli", "train", "--help"], cwd=tree,
                                     env={**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "300"},
                                     capture_output=True, text=True).stdout for rev, tree in trees.items()}
        for i, spec in enumerate(schedule(revs, args.threads, args.repeats)):
            out = Path(d) / f"run{i}"
            argv_ = command(supported(base, helps[spec.rev]), spec.threads, out)
            med = run_one(trees[spec.rev], argv_, env, args.busy, out)
            results.append((spec, med))
            print(f"  {rev_label(spec.rev)} threads={spec.threads_label}: "
                  + " ".join(f"{p} {v:.2f}s" for p, v in med.items())
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    rows = summarize(results, revs)
    print(markdown(rows, revs))
    if args.out:
        from arenobench.lib import write_json

        write_json(args.out, {"revs": revs, "env": env, "busy": args.busy, "summary": rows,
                              "runs": [{"rev": s.rev, "threads": s.threads_label, **m} for s, m in results]})
