#!/usr/bin/env python
"""areno's embedded demo vs TRL's GRPOTrainer on the same task, in one run.

Both run in their own subprocess, one after the other (areno first, then --ref's
demo, then the variants, TRL last), on CPU:

  areno  `python -m areno.cli train --max-steps N --seed S --output-dir TMP --no-save`,
         i.e. `areno train` with no model: the demo preset (tiny "arith" model,
         16 prompts x 8 samples, 3 new tokens, lr 3e-4 cosine to 0.1x, token-mean,
         transformers' generate in the rank).
  variants   (--variant NAME="FLAGS", repeatable) areno's demo with more flags,
             e.g. --variant areno-vllm="--rollout-engine vllm"
                  --variant areno-2t="--cpu-threads 2" (TRL's thread count)
  trl    GRPOTrainer (HF generate, no vLLM) on the same model, prompts
         (`areno.data.tasks.arith.rows()`, plain text, no chat template) and reward
         (`areno.data.tasks.arith.reward_fn`; "stop" = the completion ended with an EOS
         id), with the same hyper-parameters: per_device_train_batch_size 128,
         num_generations 8, max_completion_length 3, lr 3e-4 cosine_with_min_lr
         (min_lr_rate 0.1), no warmup, beta 0, temperature 1, clip 0.2, grad-norm
         clip 1, fp32, no gradient checkpointing (GRPOConfig's default is on),
         loss_type "dapo": sum of token losses / active tokens in the batch, which
         with one process and one optimizer step per generation batch is the plain
         token mean ("bnpo" is the same here; "grpo" is a mean of sequence means).

Timing, the same for both: wall = process start to exit, as seen by this script;
a step's time = when this script first saw its line in the child's metrics file
(areno's metrics.jsonl, or the jsonl a TRL callback writes on each log; polled
every 20 ms). s/step = (seen[last] - seen[5]) / (last - 5), the steady rate with
logging included; "own s/step" is what each trainer times itself (areno's
time/step, TRL's on_step_begin -> on_step_end) over the same steps. Final reward:
mean of the last 20 steps; "to 0.9": the first step whose 20-step moving-average
reward is >= 0.9, and the second (from process start) it was seen.

This script installs nothing. Without `trl` it prints how to install it aside
and runs areno alone (or exits 2 with --require-trl).

Usage:
  python scripts/bench_demo_vs_trl.py                     # 600 steps each, a few minutes
  python scripts/bench_demo_vs_trl.py --steps 50 --seed 1 --json /tmp/vs_trl.json
  PYTHONPATH=.:/tmp/trlsite python scripts/bench_demo_vs_trl.py --require-trl
  PYTHONPATH=.:/tmp/trlsite python scripts/bench_demo_vs_trl.py --ref main   # + main's demo, the ratio to it
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEADY_FROM = 5  # steps excluded from s/step (startup, first-call warmup)
WINDOW = 20  # moving-average window and final-reward window
TARGET = 0.9
RATIOS = (("s/step", "s_per_step"), ("own s/step", "own_s_per_step"), ("wall", "wall_s"), ("s to 0.9", "to_target_s"))
INSTALL_HINT = (f"{sys.executable} -m pip install -q --no-deps --target /tmp/trlsite trl==1.16.0 accelerate"
                f"\n  then: PYTHONPATH={REPO}:/tmp/trlsite {sys.executable} {Path(__file__).name} ...")


def trl_child(steps: int, seed: int, out_dir: Path) -> None:
    """The TRL run (inside its own process); one jsonl line per logged step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        print(f"import trl failed: {e}", flush=True)
        raise SystemExit(3) from None

    from areno.data.tasks.arith import reward_fn, rows
    from areno.models.tiny import tiny_model_path

    path = tiny_model_path("arith")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos_ids = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])}

    class Rec:  # the fields areno's reward_fn reads from a record
        def __init__(self, completion: str, answer: str, stopped: bool) -> None:
            self.completion, self.answer = completion, answer
            self.finish_reason = "stop" if stopped else "length"

    def arith_reward(completions: list[str], completion_ids: list[list[int]], answer: list[str],
                     **_: Any) -> list[float]:
        return [reward_fn(Rec(c, a, bool(ids) and ids[-1] in eos_ids))
                for c, ids, a in zip(completions, completion_ids, answer)]

    log = open(out_dir / "trl_steps.jsonl", "w", buffering=1)

    class StepLog(TrainerCallback):
        t0 = dt = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
            self.dt = time.perf_counter() - self.t0

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "reward" in logs:
                log.write(json.dumps({"step": state.global_step, "reward/mean": logs["reward"],
                                      "time/step": self.dt}) + "\n")

    args = GRPOConfig(
        output_dir=str(out_dir / "trl"), max_steps=steps, seed=seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=128, num_generations=8, max_completion_length=3,
        learning_rate=3e-4, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, loss_type="dapo", beta=0.0, epsilon=0.2, temperature=1.0,
        use_vllm=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list(rows()), callbacks=[StepLog()])
    trainer.train()
    log.close()


def run_child(name: str, cmd: list[str], metrics: Path, log_path: Path, root: Path = REPO) -> dict[str, Any]:
    """Run one trainer from the checkout `root`; stamp each metrics line with the
    second this script first saw it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    recs: list[dict[str, Any]] = []
    buf, pos = "", 0
    with open(log_path, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=logf, stderr=subprocess.STDOUT)
        while True:
            done = proc.poll() is not None
            if metrics.exists():
                with open(metrics) as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                now = time.perf_counter() - t0
                buf += chunk
                *lines, buf = buf.split("\n")
                recs += [{**json.loads(ln), "seen_s": now} for ln in lines if ln.strip()]
            if done:
                break
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        if proc.returncode == 3:  # the TRL child could not import trl or its dependencies
            raise SystemExit(f"{name}: {log_path.read_text(errors='replace').strip().splitlines()[-1]}\n"
                             f"Install it aside with\n  {INSTALL_HINT}")
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name} exited with {proc.returncode}; its output ends:\n{tail}")
    return summarize(name, wall, recs)


def summarize(name: str, wall: float, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The table row of one run from its per-step records."""
    rewards = [r["reward/mean"] for r in recs]
    steady = recs[STEADY_FROM:]
    row: dict[str, Any] = {"trainer": name, "wall_s": wall, "steps": len(recs),
                           "first_step_s": recs[0]["seen_s"] if recs else None,
                           "s_per_step": None, "own_s_per_step": None, "final_reward": None,
                           "to_target_step": None, "to_target_s": None}
    if len(steady) >= 2:
        row["s_per_step"] = (steady[-1]["seen_s"] - recs[STEADY_FROM - 1]["seen_s"]) / len(steady)
        row["own_s_per_step"] = sum(r["time/step"] for r in steady) / len(steady)
    if rewards:
        tail = rewards[-WINDOW:]
        row["final_reward"] = sum(tail) / len(tail)
    for i in range(WINDOW - 1, len(recs)):
        if sum(rewards[i - WINDOW + 1:i + 1]) / WINDOW >= TARGET:
            row["to_target_step"], row["to_target_s"] = recs[i]["step"], recs[i]["seen_s"]
            break
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_table(rows: list[dict[str, Any]], ratios: dict[str, float | None]) -> None:
    def f(v: Any, fmt: str, none: str = "n/a") -> str:
        return none if v is None else format(v, fmt)

    w = max([10] + [len(r["trainer"]) for r in rows])
    head = f"{'trainer':<{w}} {'wall s':>7} {'steps':>5} {'s/step':>7} {'own s/step':>10} " \
           f"{'final reward':>12} {'step to 0.9':>11} {'s to 0.9':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['trainer']:<{w}} {r['wall_s']:>7.1f} {r['steps']:>5} {f(r['s_per_step'], '.4f'):>7} "
              f"{f(r['own_s_per_step'], '.4f'):>10} {f(r['final_reward'], '.3f'):>12} "
              f"{f(r['to_target_step'], 'd', 'never'):>11} {f(r['to_target_s'], '.1f', 'never'):>8}")
    for k, v in ratios.items():
        print(f"{k}: {'n/a' if v is None else format(v, '.2f')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600, help="steps of each run (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the table here as JSON")
    p.add_argument("--require-trl", action="store_true", help="exit 2 if trl is not importable")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                   help="add a row: areno's demo with these flags (repeatable)")
    p.add_argument("--ref", metavar="REV", help="also run REV's demo (a git worktree), right after this "
                   "checkout's, and print this checkout / REV")
    p.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)  # internal: run TRL here
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be >= 1")
    variants = []
    for v in a.variant:
        name, sep, flags = v.partition("=")
        if not sep or not name or name in ("areno", "trl"):
            p.error(f"--variant {v!r}: expected NAME=FLAGS with a new NAME")
        variants.append((name, shlex.split(flags)))
    if a.trl_child is not None:
        trl_child(a.steps, a.seed, a.trl_child)
        return 0
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl:
        print(f"trl is not importable: TRL's half is skipped. Install it aside with\n  {INSTALL_HINT}")
        if a.require_trl:
            return 2
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_vs_trl_")))
        runs = [("areno", [], REPO)] + [(name, extra, REPO) for name, extra in variants]
        if a.ref:
            from arenobench.refs import rev_id, worktrees

            ref = rev_id(a.ref)
            tree = stack.enter_context(worktrees([ref], d))[ref]
            runs.insert(1, (f"areno@{ref}", [], tree))
        rows = []
        for name, extra, root in runs:
            print(f"{name}: {a.steps} steps, seed {a.seed} ...", flush=True)
            out = d / name.replace("@", "-")
            rows.append(run_child(name, [sys.executable, "-m", "areno.cli", "train", "--max-steps", str(a.steps),
                                         "--seed", str(a.seed), "--output-dir", str(out), "--no-save", *extra],
                                  out / "metrics.jsonl", d / f"{out.name}.log", root))
        if have_trl:
            print(f"trl: {a.steps} steps, seed {a.seed} ...", flush=True)
            rows.append(run_child("trl", [sys.executable, str(Path(__file__).resolve()), "--steps", str(a.steps),
                                          "--seed", str(a.seed), "--trl-child", str(d)],
                                  d / "trl_steps.jsonl", d / "trl.log"))
    ratios: dict[str, float | None] = {}
    if have_trl:  # areno's demo (the first row) against TRL (the last)
        ratios = {f"areno/TRL {k}": _ratio(rows[0][f], rows[-1][f]) for k, f in RATIOS}
    if a.ref:  # this checkout (the first row) against REV's (the second)
        ratios |= {f"areno/{rows[1]['trainer']} {k}": _ratio(rows[0][f], rows[1][f]) for k, f in RATIOS}
    print_table(rows, ratios)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp_json = a.json.with_suffix(a.json.suffix + ".tmp")
        tmp_json.write_text(json.dumps({"steps": a.steps, "seed": a.seed, "trl": have_trl, "rows": rows,
                                        "ratios": ratios}, indent=2) + "\n")
        tmp_json.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
