"""Third-party output goes to RUN_DIR/run.log; the terminal shows areno's lines
(--verbose: everything, as before)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from inprocess import run_here
from test_resume import HF1, REPO, SMALL, cli, ok

SNIPPET = textwrap.dedent("""
    import logging, multiprocessing as mp, os, sys, warnings
    from pathlib import Path
    from tqdm import tqdm
    from areno.rundir.log import third_party_to_log

    def child():
        from areno.rundir.log import redirect_child_output
        redirect_child_output()
        print("child print", flush=True)

    if __name__ == "__main__":
        with third_party_to_log(Path(sys.argv[1]), verbose=sys.argv[2] == "1"):
            warnings.warn("a FutureWarning", FutureWarning)
            os.write(2, b"C-level notice\\n")
            logging.getLogger("vllm.thing").warning("a vllm warning")
            for _ in tqdm(range(3), desc="Loading shards"):
                pass
            p = mp.get_context("spawn").Process(target=child)
            p.start(); p.join()
            print("areno: our line")
            print("areno: error: our error", file=sys.stderr)
        print("areno: after the run")
""")
THIRD = ("FutureWarning", "C-level notice", "a vllm warning", "Loading shards", "child print")


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_output_goes_to_run_log_unless_verbose(tmp_path, verbose):
    script = tmp_path / "snippet.py"
    script.write_text(SNIPPET)
    res = subprocess.run([sys.executable, str(script), str(tmp_path), "1" if verbose else "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    terminal = res.stdout + res.stderr
    for line in ("areno: our line", "areno: error: our error", "areno: after the run"):
        assert line in terminal
    log = (tmp_path / "run.log").read_text() if (tmp_path / "run.log").exists() else ""
    for text in THIRD:
        assert (text in terminal) == verbose, (text, terminal)
        assert (text in log) != verbose, (text, log)


@pytest.mark.slow  # a minute of end-to-end run on 2 busy cores; its parts are tested in the default tier
def test_default_startup_shows_areno_lines_only(tmp_path, areno_cache):
    """The default engine (vLLM; the demo's is transformers) and its notices,
    warnings and progress bars."""
    out = tmp_path / "run"
    res = ok(cli(["train", *SMALL, "--rollout-engine", "vllm", "--world-size", "1", "--max-steps", "1",
                  "--output-dir", str(out)],
                 areno_cache))
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    ours = ("areno", "step 1/1 ", "  sample of step 1: ", "saved checkpoint", "done:")
    assert all(ln.startswith(ours) for ln in lines), lines
    log = (out / "run.log").read_text()
    assert "Loading safetensors checkpoint shards" in log and "Warning" in log

    # --verbose (it may change on resume) shows them: HF's weight loading bar here.
    res = ok(cli(["train", *HF1, "--max-steps", "2", "--output-dir", str(out), "--resume", "latest",
                  "--verbose"], areno_cache))
    assert "Loading weights" in res.stderr


@pytest.mark.parametrize("placement", [[], ["--rollout-world-size", "1"]], ids=["colocated", "split"])
def test_every_weight_sync_is_a_line_in_run_log(tmp_path, areno_cache, placement):
    """The probe's diff against its tolerance (when it ran: the first sync) and the
    sync's seconds, every sync, colocated and in split placement's loop."""
    import re

    out = tmp_path / "run"
    ok(run_here(["train", *HF1, "--max-steps", "2", "--no-save", *placement, "--output-dir", str(out)],
                areno_cache))
    lines = [ln for ln in (out / "run.log").read_text().splitlines() if ln.startswith("areno: weight sync ")]
    # colocated: after each update; split: rollout 2 loads v1 (rollout 1 samples the loaded model)
    assert len(lines) == (1 if placement else 2), lines
    assert re.fullmatch(r"areno: weight sync 1: probe_diff \S+ \(tolerance \S+\).*; sync_load_s \d+\.\d{3}.*",
                        lines[0]), lines
    assert placement or lines[1].startswith("areno: weight sync 2: probe not due (fingerprint checked)"), lines
