"""VLLMEngine tests that need an engine of their own (a multiprocess one). The
RolloutEngine contract, and how the engine reads vLLM's flat log-probs, run on
the shared in-process engine in test_engine_contract.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")


@pytest.mark.slow
def test_multiprocess_engine_updates_weights_through_shm(tiny_chat_path):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: tensors cannot cross collective_rpc, so
    the push goes through a safetensors file under /dev/shm (removed at shutdown)."""
    script = textwrap.dedent(
        f"""
        import numpy as np, torch
        from transformers import AutoModelForCausalLM
        from areno.rollout.engine import SamplingConfig
        from areno.rollout.probe import Probe
        from areno.rollout.vllm import VLLMEngine
        if __name__ == "__main__":
            path = {str(tiny_chat_path)!r}
            eng = VLLMEngine(path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=8 << 20)
            assert eng.multiprocess
            m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
            ids = np.arange(3, 30, dtype=np.int32)
            eng.update_weights(m.state_dict().items(), probe=Probe.from_model(m, ids, 1e-4))
            shm = eng._shm_dir
            assert (shm / "model.safetensors").is_file()
            b = eng.generate(ids, np.array([0, ids.size]), 2, SamplingConfig(max_tokens=3, ignore_eos=True))
            assert b.response_lengths.tolist() == [3, 3]
            eng.shutdown()
            assert not shm.exists()
            print("MP-OK")
        """
    )
    import areno

    root = os.path.dirname(os.path.dirname(areno.__file__))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert "MP-OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
