"""What a first contact with the CLI shows: `--help` (every default, no flag
name cut), `--version`, and `areno check`'s exit code."""

import subprocess
import sys

import pytest

import areno
from areno import envcheck
from areno.cli import main


@pytest.mark.parametrize("status,rc", [("FAIL", 1), ("WARN", 0), ("OK", 0)])
def test_check_exits_non_zero_when_a_line_fails(monkeypatch, capsys, status, rc):
    monkeypatch.setattr(envcheck, "collect", lambda: [("OK", "python", "3"), (status, "vllm", "x")])
    assert main(["check"]) == rc
    assert status in capsys.readouterr().out


def test_version_flag_and_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == areno.__version__
    out = subprocess.run([sys.executable, "-m", "areno.cli", "--version"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.strip() == areno.__version__
