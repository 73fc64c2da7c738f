"""The fault harness: run the real `areno train` in a subprocess and check that
it failed (or stopped) the way the README promises.

`run_train` runs `python -m areno.cli train ARGS` in a session of its own with
a timeout, tagging its environment with a unique `ARENO_FAULT_TAG`: every
descendant inherits it, so a grandchild that escaped the session (setsid, a
double fork re-parented to init) is still found. While the run lives the
harness records the pids that carry the tag, which owns the /dev/shm segments
named after them (areno.runtime.leftovers.NAME). `FaultRun` holds what came back;
`assert_clean` checks everything at once:

* the exit code;
* one message: exactly one line of areno's own on stderr (a line starting with
  "areno:"; the progress bar goes to stdout, library warnings are not areno's);
* no "Traceback" in stderr or stdout;
* no process left carrying the tag (waited for up to a few seconds: a killed
  process needs a moment to be reaped);
* no /dev/shm segment left by any of the run's processes;
* a consistent run directory: no temp or half-replaced checkpoint directory,
  every listed checkpoint complete, and metrics.jsonl parses line by line with
  a strict JSON parser (NaN and Infinity are refused).

`B` builds the issue's reproduction command: the tiny arith model, a small
arith.jsonl, a plugin file, `--rollout-engine hf`, tiny sizes. Tests share one
model and data set through session fixtures (`fault_data` in test_faults_probe.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from areno.rundir.checkpoint import STATE_FILE, TMP_PREFIX, list_checkpoints
from areno.fileperms import OLD_PREFIX
from areno.runtime.leftovers import NAME as SHM_NAME
from areno.runtime.leftovers import SHM_DIR

REPO = Path(__file__).resolve().parents[1]
TAG_VAR = "ARENO_FAULT_TAG"
CKPT_FILES = ("config.json", "model.safetensors", "tokenizer.json", STATE_FILE, "backend/trainer.pt")


def write_arith_data(path: Path, n: int = 16) -> Path:
    """n rows of the demo task (`{"prompt": "a+b=", "answer": "c"}`) as JSONL."""
    from areno.data.tasks import arith

    rows = list(arith.rows())[:n]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_plugin(path: Path, body: str) -> Path:
    """A reward plugin file holding `body` (Python source defining reward_fn)."""
    path.write_text(body)
    return path


def B(model: Path, data: Path, plugin: Path, out: Path, *extra: str) -> list[str]:
    """The issue's B command line (after `areno train`), then `extra` flags."""
    return ["--ckpt", str(model), "--dataset-path", str(data), "--reward-fn-path", str(plugin),
            "--no-chat-template", "--max-new-tokens", "3", "--batch-size", "4", "--n-samples", "4",
            "--max-steps", "2", "--rollout-engine", "hf", "--output-dir", str(out), *extra]


# -- processes ------------------------------------------------------------------
def is_peer(cmdline: str) -> bool:
    """A rank or engine process: its title (procs/lifecycle.set_title, where
    setproctitle is installed), or multiprocessing's spawn command line before
    it sets one (or without setproctitle)."""
    return cmdline.startswith(("areno: rank ", "areno: engine ")) or "spawn_main" in cmdline


def tagged_pids(tag: str) -> dict[int, str]:
    """pid -> cmdline of every live (non-zombie) process whose environment holds
    TAG_VAR=tag."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z":
            found[int(d.name)] = cmd.strip()
    return found


def wait_tagged_gone(tag: str, seconds: float = 8.0) -> dict[int, str]:
    """Poll until no process carries the tag; returns those still alive at the end."""
    deadline = time.monotonic() + seconds
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_tagged(tag: str) -> None:
    """SIGKILL whatever still carries the tag (the harness's own clean-up, after
    the assertions have looked)."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _shm_owned(pids: set[int]) -> list[str]:
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if (m := SHM_NAME.match(n)) and int(m.group(1)) in pids)


# -- one run ------------------------------------------------------------------------
@dataclass
class FaultRun:
    """What one `areno train` run left: its exit code (None: killed at the
    harness timeout), output, run directory, and every pid seen carrying its tag."""

    returncode: int | None
    stdout: str
    stderr: str
    run_dir: Path
    seconds: float
    tag: str
    pids_seen: set[int] = field(default_factory=set)

    @property
    def messages(self) -> list[str]:
        """areno's own stderr lines ("areno: ..."), in order."""
        return [ln.strip() for ln in self.stderr.splitlines() if ln.startswith("areno:")]

    @property
    def message(self) -> str:
        """The one areno line on stderr (fails when there is not exactly one)."""
        lines = self.messages
        assert len(lines) == 1, f"expected one areno line on stderr, got {len(lines)}:\n{self.tail()}"
        return lines[0]

    def tail(self, n: int = 3000) -> str:
        return f"rc={self.returncode}\n--- stdout\n{self.stdout[-n:]}\n--- stderr\n{self.stderr[-n:]}"


class Run:
    """`areno train ARGS` started in a session of its own; `during(fn)` lets a
    test act on the live run (signal a rank, wait for a file), `finish()` waits."""

    def __init__(self, args: list[str], cache: Path, run_dir: Path, env: dict | None = None) -> None:
        self.tag = uuid.uuid4().hex
        self.run_dir = run_dir
        self.pids_seen: set[int] = set()
        self._t0 = time.monotonic()
        full_env = {**os.environ, "ARENO_CACHE": str(cache), "PYTHONUNBUFFERED": "1",
                    "COLUMNS": "500", TAG_VAR: self.tag, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "areno.cli", "train", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO, env=full_env, start_new_session=True)
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._record_pids, daemon=True)
        self._watch.start()

    def _record_pids(self) -> None:
        while not self._stop.is_set():
            self.pids_seen |= set(tagged_pids(self.tag))
            self._stop.wait(0.3)

    def children(self) -> dict[int, str]:
        """The live processes of the run other than the controller."""
        return {p: c for p, c in tagged_pids(self.tag).items() if p != self.proc.pid}

    def wait_for(self, predicate: Callable[[], object], timeout: float = 120.0, every: float = 0.05):
        """Poll predicate() until truthy; AssertionError if the run exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if got := predicate():
                return got
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited first:\n{self.finish().tail()}")
            time.sleep(every)
        raise AssertionError("timed out waiting on the run")

    def finish(self, timeout: float = 240.0) -> FaultRun:
        """Wait for the run (SIGKILL of its session past `timeout`, returncode None)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
            rc: int | None = self.proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            rc = None
        self._stop.set()
        self._watch.join()
        self.pids_seen |= set(tagged_pids(self.tag)) | {self.proc.pid}
        return FaultRun(rc, out, err, self.run_dir, time.monotonic() - self._t0, self.tag,
                        self.pids_seen)


def run_train(args: list[str], cache: Path, run_dir: Path, timeout: float = 240.0,
              env: dict | None = None) -> FaultRun:
    """`areno train ARGS` to its end (see Run)."""
    return Run(args, cache, run_dir, env).finish(timeout)


# -- the assertions -------------------------------------------------------------------
def assert_no_leftovers(res: FaultRun, wait_s: float = 8.0) -> None:
    """No process of the run alive and no /dev/shm segment of its processes
    left; kills stragglers afterwards so one failure does not leak into the next test."""
    try:
        left = wait_tagged_gone(res.tag, wait_s)
        assert not left, f"processes left after the run: {left}\n{res.tail()}"
        shm = _shm_owned(res.pids_seen)
        assert not shm, f"/dev/shm segments left after the run: {shm}"
    finally:
        kill_tagged(res.tag)


def strict_json(line: str) -> dict:
    """json.loads that refuses NaN, Infinity and -Infinity (Python's json accepts them)."""
    def refuse(name: str):
        raise ValueError(f"non-finite {name} in JSON: {line[:200]}")

    return json.loads(line, parse_constant=refuse)


def read_metrics_strict(run_dir: Path) -> list[dict]:
    """Every record of run_dir/metrics.jsonl, parsed strictly ([] when absent)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [strict_json(ln) for ln in path.read_text().splitlines() if ln.strip()]


def assert_consistent_run_dir(run_dir: Path, ckpt_root: Path | None = None) -> list[dict]:
    """No temp or half-replaced checkpoint directory, every checkpoint complete,
    metrics.jsonl strict JSON; returns its records."""
    root = ckpt_root or run_dir / "checkpoints"
    if root.is_dir():
        stray = [e for e in os.listdir(root) if e.startswith((TMP_PREFIX, "." + TMP_PREFIX, OLD_PREFIX))]
        assert not stray, f"temp checkpoint dirs left in {root}: {stray}"
        for ckpt in list_checkpoints(root):
            missing = [f for f in CKPT_FILES if not (ckpt / f).is_file()]
            assert not missing, f"{ckpt} lacks {missing}"
    return read_metrics_strict(run_dir)


def assert_clean(res: FaultRun, rc: int, message: Iterable[str] | None = (),
                 ckpt_root: Path | None = None) -> list[dict]:
    """All the harness checks: exit code `rc`; `message` None: no areno line on
    stderr at all, else exactly one, holding every string of `message`; no
    traceback; no leftovers; a consistent run dir. Returns the metrics records."""
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.tail()
    assert res.returncode == rc, res.tail()
    if message is None:
        assert not res.messages, res.tail()
    else:
        line = res.message
        for part in message:
            assert part in line, f"{part!r} not in {line!r}"
    assert_no_leftovers(res)
    return assert_consistent_run_dir(res.run_dir, ckpt_root)
