"""Token in, token out on the real SmolLM2-135M-Instruct with its own chat
template, through both engines: every trained token of a multi-turn trajectory
is a token the engine sampled for exactly that context (no re-tokenization),
and each observation is the template's user turn, tokenized once."""

from __future__ import annotations

import numpy as np
import pytest

from areno.envs.driver import EnvBounds, rollout_multiturn
from areno.envs.plugin import EnvState
from areno.envs.pool import EnvPool
from areno.envs.trajectory import ObservationFormat
from areno.rollout.engine import SamplingConfig
from tests.env_trace import TracingEngine, assert_token_in_token_out

ENV = '''
def step(state, completion):
    done = state.turn >= 2
    return f"Wrong. Try again ({state.turn + 1}).", float(state.turn), done
'''


def _engine(kind: str, path):
    if kind == "hf":
        from areno.rollout.hf import HFEngine

        return HFEngine(path, dtype="float32", device="cpu", max_model_len=512)
    from areno.rollout.vllm import VLLMEngine

    return VLLMEngine(path, dtype="float32", seed=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.mark.realmodel
@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_trained_tokens_are_the_sampled_tokens_on_smollm2(smol_path, tmp_path, kind):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_path)
    env = tmp_path / "env.py"
    env.write_text(ENV)
    text = tok.apply_chat_template([{"role": "user", "content": "Name a prime number."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)
    off = np.array([0, ids.size], np.int64)
    states = [EnvState(text, None, None, {}, i) for i in range(2)]
    engine = _engine(kind, smol_path)
    try:
        fmt = ObservationFormat(tok, True, (tok.eos_token_id,))
        trace = TracingEngine(engine)
        with EnvPool(str(env), workers=0) as pool:
            out = rollout_multiturn(trace, pool, tok, fmt, ids, off, states, 2,
                                    SamplingConfig(max_tokens=12, seed=5), EnvBounds(max_turns=3))
    finally:
        engine.shutdown()
    assert out.turns.tolist() == [3, 3]
    assert assert_token_in_token_out(trace, out, fmt) == 6
    whole = tok.decode(out.batch.response_tokens(0).tolist())
    assert "<|im_start|>user\nWrong. Try again (1).<|im_end|>\n<|im_start|>assistant\n" in whole
    # SmolLM2's template, not a stand-in: it names its system turn, which the
    # observation (after an assistant turn) does not repeat
    assert "SmolLM" in tok.decode(ids.tolist()) and "SmolLM" not in whole
