"""--max-new-tokens beyond the model's context: one line, exit 2, before any
engine or training rank starts, for both rollout engines."""

from __future__ import annotations

import json
import shutil

import pytest

from areno.models import info as modelinfo
from areno.errors import UserError
from areno.models.info import check_context, context_length


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


def _config(kind: str, **kw):
    import transformers

    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64)
    return getattr(transformers, kind)(**small, **kw)


@pytest.mark.parametrize("kind,kw,key", [
    ("MistralConfig", dict(sliding_window=64), "sliding_window"),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding_window"),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), "sliding_window"),
    ("Gemma2Config", dict(sliding_window=4096), "attn_logit_softcapping"),
    ("Gemma2Config", dict(sliding_window=4096, attn_logit_softcapping=None), "final_logit_softcapping"),
    ("Gemma2Config", dict(sliding_window=64, attn_logit_softcapping=None, final_logit_softcapping=None),
     "sliding_window"),
    ("CohereConfig", {}, "logit_scale"),
    ("GraniteConfig", dict(logits_scaling=8.0), "logits_scaling"),
])
def test_options_the_kernels_ignore_are_found(kind, kw, key):
    found = modelinfo.ignored_attention_option(_config(kind, **kw), longest_sequence=100)
    assert found is not None and found[0] == key, found


@pytest.mark.parametrize("kind,kw", [
    ("LlamaConfig", {}),
    ("MistralConfig", dict(sliding_window=100)),  # as long as every sequence: full attention
    ("MistralConfig", dict(sliding_window=None)),
    ("Qwen3Config", dict(use_sliding_window=False, sliding_window=64)),  # transformers drops the window
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=64, max_window_layers=2)),  # no layer uses it
    ("GraniteConfig", dict(logits_scaling=1.0)),
])
def test_plain_attention_is_accepted(kind, kw):
    assert modelinfo.ignored_attention_option(_config(kind, **kw), longest_sequence=100) is None


@pytest.mark.parametrize("extra,expect", [
    (dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2),
     "sliding_window 8 (sliding-window"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 (attention-logit softcapping)"),
])
def test_a_model_with_ignored_attention_options_is_refused_in_one_line(extra, expect, tmp_path, monkeypatch,
                                                                       capsys, tiny_arith_path):
    import areno.backend.controller
    import areno.rollout.factory
    from areno.cli import main

    def must_not_start(*args, **kwargs):
        raise AssertionError("started before the attention check")

    model = tmp_path / "m"
    shutil.copytree(tiny_arith_path, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | extra))
    monkeypatch.setattr(areno.backend.controller, "TorchBackend", must_not_start)
    monkeypatch.setattr(areno.rollout.factory, "make_engine", must_not_start)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rc = main(["train", "--ckpt", str(model), "--dataset-path", str(data),
               "--reward-fn-path", "builtin:arith", "--no-chat-template", "--batch-size", "1",
               "--n-samples", "2", "--max-new-tokens", "16", "--rollout-engine", "hf",
               "--reward-workers", "0", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert expect in err[0] and "areno's training kernels do not apply" in err[0], err
