"""CLI and config validation: every mistake is one line on stderr, exit code 2,
no traceback, and nothing heavy is started before validation."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areno.cli import main
from areno.config.train import GROUPS, TrainConfig
from areno.data.tasks.arith import DEMO_PRESET
from areno.errors import UserError


def run_cli(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def plugin(tmp_path):
    p = tmp_path / "reward.py"
    p.write_text("def reward_fn(record):\n    return 1.0\n")
    return str(p)


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return str(p)


BAD = [
    (["--bogus"], "No such option: --bogus"),
    (["--algo", "ppo"], "--algo"),
    (["--adv-mode", "mean"], "--adv-mode"),
    (["--loss-agg", "sum"], "--loss-agg"),
    (["--kl-type", "k2"], "--kl-type"),
    (["--rollout-engine", "sglang"], "--rollout-engine"),
    (["--on-reward-error", "ignore"], "--on-reward-error"),
    (["--lr", "abc"], "--lr"),
    (["--lr", "-1"], "--lr must be > 0.0"),
    (["--lr", "nan"], "--lr: must be finite"),
    (["--temperature", "0"], "--temperature must be > 0.0"),
    (["--top-p", "1.5"], "--top-p must be <= 1.0"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--max-steps", "2.5"], "--max-steps"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--n-samples", "1"], "--n-samples must be >= 2"),
    (["--clip-eps-low", "1.5"], "--clip-eps-low must be < 1.0"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--mini-batches", "100000"], "--mini-batches"),
    (["--config", "/nonexistent/run.yaml"], "--config: file not found"),
    (["--reward-fn-path", "/nonexistent/r.py"], "--reward-fn-path: file not found"),
    (["--ckpt", "./no/such/model"], "--ckpt: no model directory"),
    (["--dataset-path", "x.jsonl"], "--reward-fn-path is required with --dataset-path"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    rc, out, err = run_cli(["train", *args], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("areno: error:")
    assert needle in lines[0]
    assert "Traceback" not in err + out


def test_bad_files_name_the_flag(tmp_path, capsys, data):
    txt = tmp_path / "r.txt"
    txt.write_text("x")
    rc, _, err = run_cli(["train", "--dataset-path", data, "--reward-fn-path", str(txt)], capsys)
    assert rc == 2 and "--reward-fn-path: expected a .py file" in err
    rc, _, err = run_cli(["train", "--dataset-path", data, "--reward-fn-path", str(txt),
                          "--dataset-loader-fn", str(tmp_path / "nope.py:fn")], capsys)
    assert rc == 2 and "--reward-fn-path" in err


def test_yaml_config_flat_and_grouped_and_flag_override(tmp_path, plugin, data):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "dataset_path": data, "reward-fn-path": plugin, "lr": 1e-5,
        "rollout": {"temperature": 0.7, "max_new_tokens": 32},
        "algorithm": {"algo": "gspo"},
    }))
    cfg = TrainConfig.from_sources(str(cfg_file), {"lr": 2e-5})
    assert cfg.lr == 2e-5  # flag wins
    assert cfg.temperature == 0.7 and cfg.max_new_tokens == 32 and cfg.algo == "gspo"
    assert cfg.loss_eps() == (3e-4, 4e-4)  # gspo defaults
    assert not cfg.is_demo


@pytest.mark.parametrize("content,needle", [
    ("lr: [1, 2]\n", "--lr: expected a number"),
    ("nonsense_key: 3\n", "unknown option 'nonsense_key'"),
    ("rollout: {bogus: 1}\n", "unknown option 'bogus' under 'rollout'"),
    ("- a\n- b\n", "expected a mapping"),
    ("lr: [unclosed\n", "not valid YAML"),
    ("chat_template: maybe\n", "--chat-template: expected true or false"),
])
def test_bad_yaml_values(tmp_path, content, needle, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    rc, _, err = run_cli(["train", "--config", str(f)], capsys)
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_demo_preset_fills_only_what_was_not_given():
    cfg = TrainConfig.from_sources(None, {"lr": 1e-4})
    assert cfg.is_demo and cfg.lr == 1e-4
    assert cfg.max_new_tokens == DEMO_PRESET["max_new_tokens"]
    assert cfg.reward_fn_path == "builtin:arith"


def test_every_field_has_help_and_a_group():
    for f in TrainConfig.fields():
        assert f.metadata["help"], f.name
        assert f.metadata["group"] in GROUPS


def test_help_groups_options_by_intent():
    out = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--help"],
                         capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0
    for g in GROUPS:
        assert g in out.stdout, g
    for flag in ("--algo", "--adv-mode", "--loss-agg", "--clip-eps-high", "--tis-cap",
                 "--filter-zero-variance-groups", "--rollout-engine", "--world-size",
                 "--n-samples", "--output-dir", "--max-steps", "--seed", "--epochs"):
        assert flag in out.stdout, flag


def test_validation_happens_before_heavy_imports(tmp_path):
    # A bad value must be reported without importing torch/vllm/transformers.
    code = (
        "import sys\n"
        "from areno.cli import main\n"
        "rc = main(['train', '--lr', '-1'])\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]\n"
        "print(rc, heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr


def test_version_and_check(capsys):
    rc, out, _ = run_cli(["version"], capsys)
    assert rc == 0 and out.strip()
    rc, out, _ = run_cli(["check"], capsys)
    assert rc in (0, 1)
    for name in ("torch", "cuda", "vllm", "flash-attn"):
        assert name in out
    assert any(s in out for s in ("OK", "WARN", "FAIL"))


def test_user_error_is_one_line():
    assert str(UserError("a\nb   c")) == "a b c"


def test_console_script_exit_code(tmp_path):
    exe = Path(sys.executable).parent / "areno"
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    out = subprocess.run([str(exe), "train", "--lr", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--lr" in out.stderr
