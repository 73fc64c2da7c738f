"""A tiny Qwen3-architecture model and tokenizer, built locally: no download.

Used by the tests and by the embedded demo (`areno train` with no model). The
build is deterministic: the tokenizer is a byte-level BPE trained on a corpus
defined in this file, and every weight is drawn from its own generator seeded
by (seed, parameter name), so it does not depend on transformers' init order.

Two variants:
  "chat"   ~512-token byte-level BPE over a small English + arithmetic corpus,
           with a Qwen-style chat template; for tests and GSM8K-format examples.
  "arith"  17 tokens: digits, `+`, `=`, `:`, space and the 3 special tokens, no
           merges; a random policy hits a right one-digit answer ~1/15 of the
           time, which is what makes the demo's reward dense enough to learn.
           Text outside that alphabet is dropped by this tokenizer.

The result is an HF directory (config.json, model.safetensors, tokenizer files,
generation_config.json) that transformers and vLLM load as is. It is built once
into a cache dir, in a temp dir first and then renamed, so a half-written
model is never visible.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from areno.fileperms import build_once

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen-style ChatML template: system/user/assistant turns, optional generation prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Bump when the build changes in a way the parameters below do not capture.
_BUILD_REVISION = 2

# ByteLevel maps printable ASCII to itself and space to 'Ġ'.
_ARITH_ALPHABET = tuple("0123456789+=:") + ("\u0120",)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model learns to add numbers.
Question: Tom has 3 apples and buys 4 more. How many apples does he have now?
Answer: Tom starts with 3 apples. He buys 4 more, so he has 3 + 4 = 7 apples.
The answer is 7.
Question: A train travels 60 miles in 2 hours. What is its speed in miles per hour?
Answer: The speed is 60 / 2 = 30 miles per hour. The answer is 30.
Reinforcement learning rewards the policy when the answer is right and the format
is correct. The user asks a question, the assistant thinks step by step and then
gives the final answer after four hashes, like this: #### 42.
She reads a book every week. They walked to the market and bought bread, milk and
eggs. It was a sunny day in the city, and the children played in the park until
the evening. We write short sentences so that the tokenizer sees common words.
You are a helpful assistant. Please reason step by step, and put your final answer
at the end. Let us think about this problem carefully before we answer it.
"""


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model; its hash names the cache dir."""

    variant: str
    vocab_target: int  # BPE trainer vocab_size (specials + alphabet + merges)
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM CPU attention supports 32/64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    seed: int = 0
    revision: int = _BUILD_REVISION

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True) + _corpus(self.variant)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


VARIANTS = {
    "chat": TinySpec(variant="chat", vocab_target=512),
    "arith": TinySpec(variant="arith", vocab_target=len(SPECIAL_TOKENS) + len(_ARITH_ALPHABET)),
}


def _corpus(variant: str) -> str:
    """The training text for the tokenizer; deterministic, built-in."""
    if variant == "arith":
        lines = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
        return "\n".join(lines) + "\nanswer: 1 2 3\n"
    arith = [f"What is {a} + {b}? {a} + {b} = {a + b}." for a in range(0, 50, 7) for b in range(3, 40, 9)]
    arith += [f"{a} * {b} = {a * b}, {a} - {b} = {a - b}" for a in range(2, 30, 5) for b in range(1, 12, 4)]
    return _ENGLISH + "\n".join(arith) + "\n"


def default_cache_dir() -> Path:
    env = os.environ.get("ARENO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "areno"


def tiny_model_path(variant: str = "chat", cache_dir: str | Path | None = None) -> Path:
    """Build (once) and return the HF directory of the tiny model `variant`.

    The directory is `<cache_dir>/tiny-<variant>-<hash of the build spec>`; the
    build runs in a temp dir beside it and is renamed into place, so concurrent
    builders never see (or leave) a half-written model.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny model variant {variant!r}; valid: {', '.join(VARIANTS)}")
    spec = VARIANTS[variant]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return build_once(root / f"tiny-{variant}-{spec.digest()}", lambda tmp: build_tiny_model(spec, tmp))


def build_tokenizer(spec: TinySpec):
    """Train the byte-level BPE of `spec` and wrap it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if spec.variant == "arith":
        alphabet = list(_ARITH_ALPHABET)
        limit = len(alphabet)
    else:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        limit = None
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
        **({"limit_alphabet": limit} if limit is not None else {}),
    )
    corpus = _corpus(spec.variant).splitlines()
    tok.train_from_iterator(corpus, trainer=trainer)
    if spec.variant == "arith":
        vocab = tok.get_vocab()
        assert len(vocab) == spec.vocab_target, f"arith vocab has {len(vocab)} tokens: {sorted(vocab)}"
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(spec: TinySpec, out_dir: str | Path) -> None:
    """Write the HF directory of `spec` into `out_dir` (which may exist, empty)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        initializer_range=spec.init_std,
        dtype="float32",
    )
    model = Qwen3ForCausalLM(config).to(torch.float32)
    _init_weights(model, spec)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
        bos_token_id=ids[PAD_TOKEN],
        do_sample=True,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its own class name ("TokenizersBackend"); the 4.x name
    # loads in both, and vLLM loads through AutoTokenizer either way.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "areno_tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")


def _init_weights(model, spec: TinySpec) -> None:
    """Norm weights 1, everything else N(0, init_std), each from its own
    generator seeded by (seed, name): independent of module construction order."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            h = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * spec.init_std)
