"""Weight-sync scenarios on one in-process rank (run as a script by
tests/test_engines.py, so its process group and engine stay out of pytest's
process). Prints one JSON object: scenario -> "ok" | the error message;
"probes": the reply's probe figures of each successful sync ({} where the
probe did not run).

Scenarios, in order, each after a real sync of the trainer's weights:
  correct        the weights as they are (the calibration sync);
  corrupted      one layer's tensor x1.01 on its way into the engine;
  correct_again  a correct sync after the corrupted one (no probe: fingerprinted);
  calibrated     a correct sync where the probe is due again (sync 50): its
                 tolerance is the one the first sync calibrated;
  stale          the trainer moves one AdamW step at the demo's lr, the engine
                 keeps the previous step's weights;
  partial        the trainer moves again, the engine loads all but one tensor.

usage: python tests/probe_scenarios.py MODEL_DIR ENGINE DTYPE PORT [correct]
("correct": the first scenario only, for the real model's slower syncs)

`scaled_logits_model` (imported by conftest) builds the scaled-logit tiny model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

CORRUPT = "model.layers.1.self_attn.o_proj.weight"
DROPPED = "model.layers.1.self_attn.k_proj.weight"  # vLLM fuses it into qkv_proj
# The demo's lr: one AdamW step moves every element by about lr on the first step.
STEP = 3e-4
# Largest |logit| the scaled tiny model reaches on the probe: a real model's 20-30.
TARGET_LOGIT_SCALE = 25.0


def scaled_logits_model(src: Path, dst: Path, probe: "object") -> Path:
    """Copy the HF dir `src` to `dst` with lm_head scaled so that max |logit| on
    the token ids `probe` is TARGET_LOGIT_SCALE (the tiny chat model's are ~1):
    the real-model logit scale, at tiny cost. Written once (atomic rename)."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM

    from areno.fileperms import honour_umask

    if (dst / "config.json").is_file():
        return dst
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        scale = float(model(input_ids=torch.as_tensor(probe, dtype=torch.long)[None]).logits.abs().max())
        model.lm_head.weight.mul_(TARGET_LOGIT_SCALE / scale)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        model.save_pretrained(tmp)
        for f in src.iterdir():
            if f.is_file() and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        honour_umask(tmp)  # mkdtemp is 0700 and transformers writes safetensors 0600
        try:
            os.rename(tmp, dst)
        except OSError:  # another process built it first
            if not (dst / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def main(model: str, kind: str, dtype: str, port: str, which: str = "all") -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from areno.backend.config import BackendConfig
    from areno.backend.weights import probe_ids
    from areno.backend.worker import RankWorker
    from areno.rollout.factory import EngineSpec
    from areno.rollout.probe import PROBE_EVERY_FINGERPRINTED

    cfg = BackendConfig(model_path=model, world_size=1, dtype=dtype,
                        engine=EngineSpec(kind=kind, dtype=dtype, max_model_len=64, kv_cache_bytes=64 << 20))
    w = RankWorker(cfg)
    ids = probe_ids(w.vocab_size)
    load = w.engine.load_weights
    out: dict = {"probes": []}

    def attempt(name: str, loader) -> None:
        w.engine.load_weights = loader
        try:
            reply = w.cmd_sync_weights(ids)
            out[name] = "ok"
            out["probes"].append({k: v for k, v in reply.items() if k.startswith("probe_") and k != "probe_s"})
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"
        w.engine.load_weights = load

    def train_step(seed: int) -> None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for p in w.hf.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shard
                local.add_(STEP * torch.sign(torch.randn(local.shape, generator=g)))

    attempt("correct", load)
    if which == "correct":
        w.close()
        return out
    attempt("corrupted", lambda named: load((n, t * 1.01 if n == CORRUPT else t) for n, t in named))
    attempt("correct_again", load)
    w.sync_check.syncs = PROBE_EVERY_FINGERPRINTED
    attempt("calibrated", load)
    train_step(0)
    attempt("stale", lambda named: [None for _ in named])
    train_step(1)
    attempt("partial", lambda named: load((n, t) for n, t in named if n != DROPPED))
    w.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:6])))
