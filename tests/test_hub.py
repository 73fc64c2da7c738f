"""Hub ids without a network: one line within seconds, saying the id could not be
fetched and how to use a local copy; a cached copy is used offline.

"No network" is made portable by pointing HF_ENDPOINT at a closed local port
(connection refused at once), with an empty HF cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import constants

from areno.data import hub
from areno.errors import UserError

CLOSED = "http://127.0.0.1:9"


@pytest.fixture
def restore_offline(monkeypatch):
    """go_offline() changes process globals; put them back after the test."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)


def offline_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                             "HF_DATASETS_OFFLINE")}
    env.update(HF_ENDPOINT=CLOSED, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf/hub"),
               HF_DATASETS_CACHE=str(tmp_path / "hf/datasets"))
    return env


def train(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    plugin = tmp_path / "r.py"
    plugin.write_text("def reward_fn(record):\n    return 1.0\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "areno.cli", "train", *args, "--reward-fn-path",
                          str(plugin), "--output-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=120)
    return out, time.monotonic() - t0


@pytest.mark.alone
def test_unreachable_model_id_is_one_fast_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    out, took = train(["--ckpt", "nosuchorg/nosuchmodel", "--dataset-path", str(data)],
                      offline_env(tmp_path), tmp_path)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert ("--ckpt nosuchorg/nosuchmodel: not a local directory, and could not be fetched from "
            "the Hugging Face hub") in err[0]
    assert "--local-dir DIR" in err[0] and "HF_HUB_OFFLINE=1" in err[0]
    assert took < 30, took


@pytest.mark.alone
def test_unreachable_dataset_id_is_one_fast_line(tmp_path, tiny_arith_path):
    out, took = train(["--ckpt", str(tiny_arith_path), "--dataset-path", "gsm8k:main"],
                      offline_env(tmp_path), tmp_path)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert "could not fetch dataset 'openai/gsm8k', config 'main'" in err[0]
    assert "local .jsonl" in err[0]
    assert took < 30, took


def test_cached_model_is_used_offline_when_the_hub_is_unreachable(tmp_path, tiny_arith_path):
    snap = tmp_path / "hf/hub/models--someorg--tiny/snapshots/abc"
    shutil.copytree(tiny_arith_path, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs/main").write_text("abc")
    code = ("import os\nfrom areno.data.hub import check_model_id\ncheck_model_id('someorg/tiny')\n"
            "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained('someorg/tiny')\n"
            "print(os.environ['HF_HUB_OFFLINE'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=offline_env(tmp_path), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
    assert "using the cached copy of someorg/tiny" in out.stderr


def test_missing_model_and_dataset_ids_say_so(monkeypatch, restore_offline):
    monkeypatch.setattr(hub, "hub_status", lambda *a: hub.HubStatus("missing", "404"))
    with pytest.raises(UserError, match="--ckpt nosuchorg/x: not a local directory, and no such model on the Hugging Face hub"):
        hub.check_model_id("nosuchorg/x")
    from areno.data.rows import load_rows

    with pytest.raises(UserError, match="no dataset 'nosuchorg/x', split 'train' on the Hugging Face"):
        load_rows("nosuchorg/x")


def test_offline_mode_needs_the_model_in_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "hub_status", lambda *a: pytest.fail("no request when offline"))
    with pytest.raises(UserError, match="not in the Hugging Face cache while HF_HUB_OFFLINE is set"):
        hub.check_model_id("nosuchorg/x")


def test_a_local_directory_is_never_looked_up(monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "hub_status", lambda *a: pytest.fail("a local path is not a hub id"))
    hub.check_model_id(str(tmp_path))


def test_go_offline_reaches_huggingface_hub_datasets_and_child_processes(restore_offline):
    import datasets.config

    hub.go_offline()
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE
    assert os.environ["HF_HUB_OFFLINE"] == "1" and hub.is_offline()
