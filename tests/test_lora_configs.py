"""Adapters from other tools (issue 26, 3): every adapter_config.json field that
areno honours gives PeftModel.from_pretrained's logits on the trainer (golden)
and syncs exactly into the engines; every field it cannot serve exactly is a
one-line UserError naming it (config.lora.adapter_settings)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from areno.backend.config import LoraSpec
from areno.config.lora import adapter_settings
from areno.errors import UserError

PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3, 64, 11]])


def saved_adapter(base_path, out, seed: int = 0, **config):
    """A peft adapter of `base_path` saved with save_pretrained (random non-zero A
    and B, as another tool would leave it) -> its directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    kw = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) | config
    model = get_peft_model(base, LoraConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    for f in base_path.iterdir():  # tokenizer files: a whole adapter directory, as --ckpt wants
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy2(f, out / f.name)
    return out


def peft_logits(base_path, adapter) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=PROMPT).logits


def areno_spec(adapter) -> LoraSpec:
    saved = json.loads((adapter / "adapter_config.json").read_text())
    return LoraSpec(**adapter_settings(saved, str(adapter)), adapter_path=str(adapter))


HONOURED = {
    "r, lora_alpha, targets": {},
    "use_rslora": {"use_rslora": True},
    "lora_dropout": {"lora_dropout": 0.1},
    "all-linear": {"target_modules": "all-linear", "r": 2, "lora_alpha": 3},
    "init-only": {"init_lora_weights": "gaussian", "inference_mode": True},
}


@pytest.mark.parametrize("case", list(HONOURED))
def test_honoured_fields_give_peft_logits_on_the_trainer(case, tiny_chat_path, tmp_path) -> None:
    """areno's trainer (apply_lora of the saved adapter, as resume and --ckpt
    build it) computes PeftModel.from_pretrained's logits (fp32, 1e-6; before
    rsLoRA was honoured its case differed by ~0.1)."""
    from areno.backend.lora import apply_lora
    from areno.backend.model import load_hf_model

    adapter = saved_adapter(tiny_chat_path, tmp_path / "a", **HONOURED[case])
    want = peft_logits(tiny_chat_path, adapter)
    spec = areno_spec(adapter)
    hf = apply_lora(load_hf_model(tiny_chat_path, "sdpa", torch.device("cpu")), spec, str(tiny_chat_path),
                    spec.adapter_path)
    with torch.no_grad():
        got = hf(input_ids=PROMPT).logits
        base = load_hf_model(tiny_chat_path, "sdpa", torch.device("cpu"))(input_ids=PROMPT).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_an_rslora_adapter_syncs_exactly_into_the_engines(kind, tiny_chat_path, monkeypatch, tmp_path) -> None:
    """A real RankWorker resuming an rsLoRA adapter: its engine (hf, vLLM) serves
    it with alpha/sqrt(r): the start-up sync's checksum and probe pass."""
    from areno.backend.weights import probe_ids
    from areno.rollout.factory import EngineSpec
    from test_backend_units import local_worker

    adapter = saved_adapter(tiny_chat_path, tmp_path / "a", use_rslora=True, r=8, lora_alpha=4)
    spec = areno_spec(adapter)
    assert spec.use_rslora
    engine = EngineSpec(kind=kind, dtype="float32", max_model_len=64, kv_cache_bytes=64 << 20, max_lora_rank=8)
    with local_worker(tiny_chat_path, monkeypatch, lora=spec, engine=engine) as worker:
        assert worker.hf.areno_peft.peft_config["default"].use_rslora
        out = worker.cmd_sync_weights(probe_ids(worker.vocab_size))
        assert out["probe_diff"] <= out["probe_tolerance"]


REFUSED = {
    "use_dora": True,
    "alpha_pattern": {"q_proj": 16},
    "rank_pattern": {"q_proj": 2},
    "lora_bias": True,
    "bias": "all",
    "modules_to_save": ["lm_head"],
    "layers_to_transform": [0],
    "layers_pattern": "layers",
    "exclude_modules": ["k_proj"],
    "fan_in_fan_out": True,
    "init_lora_weights": "pissa",
    "target_parameters": ["mlp.experts.down_proj"],
    "trainable_token_indices": [1, 2],
    "layer_replication": [[0, 1]],
    "use_qalora": True,
    "megatron_config": {"tensor_model_parallel_size": 2},
    "some_future_field": True,
}


def peft_saved_config(tmp_path, **kw) -> dict:
    """adapter_config.json as peft's save_pretrained writes it (every field)."""
    from peft import LoraConfig

    LoraConfig(**kw).save_pretrained(str(tmp_path))
    return json.loads((tmp_path / "adapter_config.json").read_text())


@pytest.mark.parametrize("field", list(REFUSED))
def test_each_field_areno_cannot_serve_is_refused_by_name(field, tmp_path) -> None:
    """A saved adapter config (as peft writes it: every field) with one field
    set areno would otherwise drop: one line naming it."""
    saved = peft_saved_config(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj"]) | {field: REFUSED[field]}
    with pytest.raises(UserError) as e:
        adapter_settings(saved, "/x/adapter")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("/x/adapter: ") and f"sets {field}=" in msg, msg


def test_a_pattern_target_and_a_peft_default_config(tmp_path) -> None:
    saved = peft_saved_config(tmp_path, r=4, target_modules=["q_proj"])
    assert adapter_settings(saved, "x") == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ("q_proj",),
                                            "use_rslora": False}
    with pytest.raises(UserError, match="target_modules is the pattern"):
        adapter_settings(saved | {"target_modules": r".*\.q_proj"}, "x")


def test_an_adapter_of_some_layers_only_is_refused(tiny_chat_path, tmp_path) -> None:
    """Full module paths in target_modules (one layer's q_proj): areno adapts every
    q_proj, so the saved adapter does not cover them: one line at planning time."""
    from areno.backend.lora import lora_plan

    adapter = saved_adapter(tiny_chat_path, tmp_path / "a", target_modules=["model.layers.0.self_attn.q_proj"])
    spec = areno_spec(adapter)
    assert spec.target_modules == ("q_proj",)
    with pytest.raises(UserError, match="the adapter has no lora_A for model.layers.1.self_attn.q_proj"):
        lora_plan(str(tiny_chat_path), spec)
    whole = saved_adapter(tiny_chat_path, tmp_path / "b", target_modules="all-linear")
    lora_plan(str(tiny_chat_path), areno_spec(whole))  # peft's full paths of every linear: accepted


def test_a_dora_adapter_on_the_cli_is_one_line_exit_2(tiny_arith_path, tmp_path, areno_cache) -> None:
    from inprocess import run_here

    adapter = saved_adapter(tiny_arith_path, tmp_path / "dora", use_dora=True)
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    res = run_here(["train", "--ckpt", str(adapter), "--eval-only", "--eval-dataset-path",
                    str(tmp_path / "eval.jsonl"), "--reward-fn-path", "builtin:arith",
                    "--output-dir", str(tmp_path / "e")], areno_cache)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sets use_dora=true" in lines[0], res.stderr


def test_an_adapter_checkpoint_with_tensor_parallel_engines_is_refused(tiny_chat_path, tmp_path) -> None:
    """--resume / --ckpt of an adapter at --tensor-parallel-size 2: one line before
    any rank starts (the adapter checksum compares whole tensors; --lora-rank with
    TP > 1 is refused at config time, test_lora's CLI cases)."""
    from areno.settings import lora_spec
    from areno.config.train import TrainConfig

    adapter = saved_adapter(tiny_chat_path, tmp_path / "a")
    assert lora_spec(TrainConfig(), str(adapter)).rank == 4
    with pytest.raises(UserError, match="LoRA with --tensor-parallel-size 2"):
        lora_spec(TrainConfig(tensor_parallel_size=2), str(adapter))
