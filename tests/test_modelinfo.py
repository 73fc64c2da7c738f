"""--max-new-tokens beyond the model's context: one line, exit 2, before any
engine or training rank starts, for both rollout engines."""

from __future__ import annotations

import json
import shutil

import pytest

from areno import modelinfo
from areno.errors import UserError
from areno.modelinfo import check_context, context_length


def test_context_length_comes_from_config_json(tiny_arith_path):
    assert context_length(str(tiny_arith_path)) == (2048, "max_position_embeddings")


def test_scaled_rope_and_unreadable_configs_are_left_to_the_engine(tmp_path, tiny_arith_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_arith_path, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(cfg))
    assert context_length(str(model)) is None
    assert context_length(str(tmp_path / "absent")) is None


def test_check_context_boundaries(monkeypatch):
    monkeypatch.setattr(modelinfo, "context_length", lambda path: (100, "max_position_embeddings"))
    check_context("m", 40, 60)  # exactly fills the context
    with pytest.raises(UserError, match=r"need 101 positions, but m has a context of 100 .*"
                       r"use --max-new-tokens 60 or less"):
        check_context("m", 40, 61)
    with pytest.raises(UserError, match="lower --max-prompt-len below 100"):
        check_context("m", 100, 1)


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_too_many_new_tokens_is_one_line_before_anything_starts(engine, tmp_path, monkeypatch,
                                                                  capsys, tiny_arith_path):
    import areno.backend.controller
    import areno.rollout.factory
    from areno.cli import main

    def must_not_start(*args, **kwargs):
        raise AssertionError("started before the context check")

    monkeypatch.setattr(areno.backend.controller, "TorchBackend", must_not_start)
    monkeypatch.setattr(areno.rollout.factory, "make_engine", must_not_start)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rc = main(["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(data),
               "--reward-fn-path", "builtin:arith", "--no-chat-template", "--batch-size", "1",
               "--n-samples", "2", "--max-new-tokens", "5000", "--rollout-engine", engine,
               "--reward-workers", "0", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--max-new-tokens 5000:" in err[0] and "context of 2048" in err[0]
