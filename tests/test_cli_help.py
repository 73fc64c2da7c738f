"""What a first contact with the CLI shows: `--help` (every default, no flag
name cut), `--version`, and `areno check`'s exit code."""

import subprocess
import sys

import pytest

import areno
from areno.cli import check as envcheck
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


def _help(columns: int) -> str:
    out = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--help"], capture_output=True,
                         text=True, env={"COLUMNS": str(columns), "PATH": "", "TERM": "dumb"})
    assert out.returncode == 0, out.stderr
    return out.stdout


def _panels(text: str) -> dict[str, str]:
    """Panel title -> the panel's text."""
    panels, name = {}, None
    for line in text.splitlines():
        if line.startswith("╭─ "):
            name = line[3:].split(" ─")[0]
            panels[name] = ""
        elif name:
            panels[name] += line + "\n"
    return panels


def test_help_shows_every_flag_whole_with_its_default_at_100_columns():
    from areno.config.train import TrainConfig
    from areno.data.tasks.arith import DEMO_PRESET
    from areno.config.fieldcheck import flag_name

    text = _help(100)
    assert "…" not in text
    for columns in (80, 100):
        words = set(_help(columns).replace("│", " ").split())
        for f in TrainConfig.fields():
            assert flag_name(f.name) in words, (columns, f.name)
    # one [default: ...] per option, and the demo's own value where it differs
    assert text.count("[default:") >= len(TrainConfig.fields())
    assert "[default: 1e-6; 1e-5 with --lora-rank > 0; demo: 0.0003]" in " ".join(text.replace("│", " ").split())
    flat = " ".join(text.replace("│", " ").split())
    for key, value in DEMO_PRESET.items():
        default = next(f.default for f in TrainConfig.fields() if f.name == key)
        if value != default:
            assert "demo: " + (f"{value:g}" if isinstance(value, float) else
                               ("off" if value is False else str(value))) in flat, key
    assert "list[float]" in flat  # rich markup would eat it unescaped


def test_every_none_default_says_what_unset_means():
    from areno.config.train import TrainConfig

    for f in TrainConfig.fields():
        if f.default is None:
            assert f.metadata["shown"], f.name


def test_batch_size_and_n_samples_are_data_and_rollout_options():
    panels = _panels(_help(120))
    assert "--batch-size" in panels["Data"] and "--n-samples" in panels["Rollout"]
    assert "--batch-size" not in panels["Parallelism"] and "--n-samples" not in panels["Parallelism"]
