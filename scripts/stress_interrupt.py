"""Interrupt `areno train` at random moments, N times, and check every outcome.

Each try starts the demo (small batches, a save every 3 steps, an eval every 4,
so saves and evals happen between rollouts and updates) in a session of its
own, and signals the whole process group, as a terminal, `timeout`, Slurm or
systemd does, at a seeded random moment: during start-up (a delay from the
launch), or at a random point inside a step (a delay after the k-th step's
metrics line). The signal is drawn from --signals (SIGINT, SIGTERM, SIGHUP);
with --double P a try sends a second one 0-30 ms after the first with
probability P; with --split K,.. a try runs split placement (one engine
process, --off-policy-steps drawn from the list, the transformers engine).
Each outcome must be: exit 130, no traceback, one `areno: interrupted` line
whose checkpoint exists, is complete and holds the step the line names (or,
before the first step, the start-up message; after a second signal that
aborted the save, the newest complete checkpoint), no process of the group
left, no new areno segment in /dev/shm. The first --resume-checks saved tries
run the printed command and interrupt it after one more step. Not in CI: one
try is a whole start-up (10-35 s on a shared 2-core host).

    python scripts/stress_interrupt.py --count 100 --seed 0
    python scripts/stress_interrupt.py --count 50 --signals INT,TERM,HUP --double 0.5 --split 1,2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from areno.runtime.leftovers import NAME, owner_alive  # the segment names areno makes

FLAGS = ["--batch-size", "4", "--n-samples", "4", "--max-steps", "5000", "--save-interval", "3",
         "--eval-interval", "4", "--eval-n", "2"]
EVAL_ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (0, 5)]]
COMPLETE = ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.json",
            "backend/trainer.pt")
GOOD = ("saved", "startup", "no-step", "aborted, newest named")
SETTLE_S = 0.2  # after the controller exits, its children's own exits (rank, resource tracker) land
LINE = re.compile(r"^areno: interrupted(?: \((SIG\w+)\))?(?: after step (\d+) of \d+)?")


@dataclass(frozen=True)
class Moment:
    """When to interrupt: `delay_s` after the launch (steps == 0) or after the
    `steps`-th step's metrics line; with `sig`, then `second` (None: no second
    signal) `gap_s` later."""

    steps: int
    delay_s: float
    sig: signal.Signals = signal.SIGINT
    second: signal.Signals | None = None
    gap_s: float = 0.0


def pick(rng: random.Random, startup_s: float, step_s: float,
         signals: tuple[signal.Signals, ...] = (signal.SIGINT,), double: float = 0.0) -> Moment:
    """A quarter of the tries during start-up, the rest at a uniform point of a step;
    the signal from `signals`, a second one 0-30 ms later with probability `double`."""
    steps, delay = (0, rng.uniform(0.0, startup_s)) if rng.random() < 0.25 else \
        (rng.randint(1, 8), rng.uniform(0.0, step_s))
    second = rng.choice(signals) if rng.random() < double else None
    return Moment(steps, delay, rng.choice(signals), second, rng.uniform(0.0, 0.03))


def shm_names() -> set[str]:
    try:
        return {p.name for p in Path("/dev/shm").iterdir() if NAME.match(p.name)}
    except OSError:
        return set()


def orphaned(names: set[str]) -> set[str]:
    """Those of `names` whose owner is gone (other areno runs on the host keep theirs)."""
    out = set()
    for n in names:
        try:
            made_at = (Path("/dev/shm") / n).lstat().st_mtime
        except OSError:
            continue  # removed meanwhile
        if not owner_alive(int(NAME.match(n).group(1)), made_at):
            out.add(n)
    return out


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group pgid."""
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(d.name))
    return alive


def steps_logged(out: Path) -> int:
    try:
        return sum(1 for ln in (out / "metrics.jsonl").read_text().splitlines()
                   if '"eval/' not in ln)
    except OSError:
        return 0


def launch(args: list[str], env: dict) -> subprocess.Popen:
    # -X faulthandler: a hung try dumps its threads on SIGABRT (see interrupt)
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "areno.cli", *args], cwd=REPO,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def interrupt(proc: subprocess.Popen, out: Path, at: Moment, timeout_s: float) -> tuple[str, str]:
    """SIGINT proc's group at `at` (or when it ends first) -> (stdout, stderr)."""
    deadline = time.monotonic() + timeout_s
    while at.steps and steps_logged(out) < at.steps and proc.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    time.sleep(at.delay_s)
    if proc.poll() is None:
        os.killpg(proc.pid, at.sig)
        if at.second is not None:
            time.sleep(at.gap_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, at.second)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # hung: its threads' stacks, then the group goes
        print(f"     hung; group {group_alive(proc.pid)}", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGABRT)
        time.sleep(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        log = out / "run.log"
        print("     stderr: " + stderr[-3000:].replace("\n", "\n     "), flush=True)
        if log.is_file():
            print("     run.log: " + log.read_text()[-3000:].replace("\n", "\n     "), flush=True)
        return stdout, stderr


def names_newest(line: str, out: Path) -> bool:
    """The line names the newest complete checkpoint of the run, or says there is none."""
    done = sorted(p for p in (out / "checkpoints").glob("step_*") if all((p / f).is_file() for f in COMPLETE))
    if not done:
        return "no checkpoint yet" in line
    return f"checkpoint {done[-1]}; continue with: " in line


def judge(rc: int, stdout: str, stderr: str, out: Path, leftover: list[int], new_shm: set[str],
          double: bool = False) -> str:
    """The outcome's category: 'saved', 'startup', 'no-step', 'aborted, newest named'
    (a second signal) or a failure's name."""
    if "Traceback" in stderr:
        return "traceback"
    if rc != 130:
        return f"exit {rc}"
    if leftover:
        return "processes left"
    if new_shm:
        return "shm left"
    lines = [ln for ln in stderr.splitlines() if ln.startswith("areno: interrupted")]
    m = LINE.match(lines[-1]) if len(lines) == 1 else None
    if m is None:
        return "no interrupted line"
    if m.group(2) is None:
        return "startup"
    step = int(m.group(2))
    if "could not be saved" in lines[0] or "was interrupted" in lines[0]:
        # A second signal aborted the save: the line must name the newest complete checkpoint.
        return "aborted, newest named" if double and names_newest(lines[0], out) else "not saved"
    if "continue with: " not in lines[0]:
        return "no-step" if step == 0 else "no checkpoint named"
    ckpt = Path(shlex.split(lines[0].split("continue with: ", 1)[1])[-1])
    if not all((ckpt / f).is_file() for f in COMPLETE):
        return "checkpoint incomplete"
    if json.loads((ckpt / "trainer_state.json").read_text()).get("step") != step:
        return "checkpoint step differs"
    return "saved"


def resume_works(stderr: str, out: Path, env: dict) -> bool:
    """Run the printed resume command; it must say where it resumed and save again."""
    line = next(ln for ln in stderr.splitlines() if ln.startswith("areno: interrupted"))
    step = int(LINE.match(line).group(2))
    cmd = shlex.split(line.split("continue with: ", 1)[1])
    proc = launch(cmd[1:], env)
    stdout, err = interrupt(proc, out, Moment(steps_logged(out) + 1, 0.0), 300)
    time.sleep(SETTLE_S)  # as for every try: judged at once, a child still exiting counted as left
    return (proc.returncode == 130 and f"resumed at step {step}" in stdout and "Traceback" not in err
            and judge(proc.returncode, stdout, err, out, group_alive(proc.pid), set()) == "saved")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100, help="interrupts (runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-s", type=float, default=8.0, help="start-up window to draw from")
    ap.add_argument("--step-s", type=float, default=0.1, help="in-step window to draw from")
    ap.add_argument("--resume-checks", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the failed tries' run dirs")
    ap.add_argument("--signals", default="INT", help="signals to draw from, e.g. INT,TERM,HUP")
    ap.add_argument("--double", type=float, default=0.0, help="probability of a second signal 0-30 ms later")
    ap.add_argument("--split", default="", help="--off-policy-steps values to draw from under split "
                    "placement (one engine process, the transformers engine); empty: colocated")
    args = ap.parse_args(argv)
    signals = tuple(signal.Signals["SIG" + n.strip().upper().removeprefix("SIG")] for n in args.signals.split(","))
    ks = [int(k) for k in args.split.split(",") if k.strip()]
    # Started in the background (`cmd &`, nohup), this process ignores SIGINT (and
    # SIGHUP), and so would every try: areno keeps an inherited SIGHUP ignore (nohup's).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "500"}
    tally: collections.Counter[str] = collections.Counter()
    resumed = resume_ok = 0
    with tempfile.TemporaryDirectory(prefix="areno-stress-") as tmp:
        evalset = Path(tmp) / "eval.jsonl"
        evalset.write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
        for i in range(args.count):
            out, at = Path(tmp) / f"run{i}", pick(rng, args.startup_s, args.step_s, signals, args.double)
            split = (["--rollout-world-size", "1", "--off-policy-steps", str(rng.choice(ks)),
                      "--rollout-engine", "hf"] if ks else [])
            shm0 = shm_names()
            proc = launch(["train", *FLAGS, *split, "--seed", str(i), "--eval-dataset-path", str(evalset),
                           "--output-dir", str(out)], env)
            stdout, stderr = interrupt(proc, out, at, 300)
            time.sleep(SETTLE_S)
            verdict = judge(proc.returncode, stdout, stderr, out, group_alive(proc.pid),
                            orphaned(shm_names() - shm0), double=at.second is not None)
            tally[verdict] += 1
            if verdict == "saved" and resumed < args.resume_checks:
                resumed += 1
                resume_ok += resume_works(stderr, out, env)
            ok = verdict in GOOD
            what = at.sig.name + (f"+{at.second.name} {at.gap_s * 1000:.0f} ms later" if at.second else "")
            print(f"{i:4d} {what} at {at.steps} steps + {at.delay_s:.3f}s{f' K={split[3]}' if split else ''}: "
                  f"{verdict}", flush=True)
            if not ok:
                print("     " + stderr.strip().splitlines()[-1][:400] if stderr.strip() else "", flush=True)
                if args.keep:
                    subprocess.run(["cp", "-r", str(out), f"/tmp/areno-stress-fail-{i}"], check=False)
    print(json.dumps({"count": args.count, "seed": args.seed, "signals": args.signals, "double": args.double,
                      "split": args.split, "tally": dict(tally),
                      "resume_checked": resumed, "resume_ok": resume_ok}))
    bad = sum(n for k, n in tally.items() if k not in GOOD)
    return 1 if bad or resume_ok < resumed else 0


if __name__ == "__main__":
    sys.exit(main())
