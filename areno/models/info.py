"""What --ckpt's config.json says about the model, read before any engine starts.

vLLM refuses a `max_model_len` beyond the model's context with a long pydantic
traceback, and transformers' generate runs past it silently; so the controller
compares prompt length + --max-new-tokens with the context first and reports a
mistake as one line.

areno's training kernels (backend/attention.py, ChunkedLogProbs) compute plain
causal softmax attention and lm_head logits; options that change that math are
refused here (issue 17, 2i), before any rank starts, instead of training on
log-probs that silently differ from the model's.
"""

from __future__ import annotations

from typing import Any

from areno.errors import UserError

# The keys vLLM reads the context from (the smallest present wins), as in its
# `_get_and_verify_max_len`.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings already is the usable context; for the
# others (linear, dynamic, yarn, ...) vLLM scales it, so the engine decides.
UNSCALED_ROPE = (None, "default", "llama3", "longrope", "su")


# Config keys whose non-neutral value changes the math areno's kernels skip:
# key -> (what it is, its neutral values). Gemma2 softcaps attention scores and
# the final logits; Cohere multiplies, Granite divides the logits.
IGNORED_MATH: dict[str, tuple[str, tuple]] = {
    "attn_logit_softcapping": ("attention-logit softcapping", (None, 0, 0.0)),
    "final_logit_softcapping": ("final-logit softcapping", (None, 0, 0.0)),
    "logit_scale": ("a logit scale", (None, 1, 1.0)),
    "logits_scaling": ("a logit scaling", (None, 1, 1.0)),
}
# Windowed attention: config key of the window -> (what it is, the layer_types
# entry of the layers that use it). A window at least as long as every sequence
# is full causal attention, so only a shorter one is refused.
WINDOWS: dict[str, tuple[str, str]] = {
    "sliding_window": ("sliding-window attention", "sliding_attention"),
    "attention_chunk_size": ("chunked attention", "chunked_attention"),
}


def _text_config(model_path: str) -> Any | None:
    """The (text) config of --ckpt, or None when it is not readable here."""
    try:
        from transformers import AutoConfig

        cfg: Any = AutoConfig.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - unknown architectures are the engine's to judge
        return None
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def context_length(model_path: str) -> tuple[int, str] | None:
    """(positions, config key) the model accepts, or None when its config does not
    say (or is not readable here, or RoPE scaling changes it)."""
    text = _text_config(model_path)
    if text is None:
        return None
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in UNSCALED_ROPE:
        return None
    found = [(v, k) for k in CONTEXT_KEYS
             if isinstance(v := getattr(text, k, None), int) and not isinstance(v, bool) and v > 0]
    return min(found) if found else None


def check_context(model_path: str, longest_prompt: int, max_new_tokens: int) -> None:
    """UserError unless the longest prompt plus --max-new-tokens fits the context."""
    ctx = context_length(model_path)
    if ctx is None:
        return
    positions, key = ctx
    need = longest_prompt + max_new_tokens
    if need <= positions:
        return
    room = positions - longest_prompt
    fix = (f"use --max-new-tokens {room} or less" if room >= 1 else
           f"lower --max-prompt-len below {positions} so prompts leave room to generate")
    raise UserError(f"--max-new-tokens {max_new_tokens}: prompts of up to {longest_prompt} tokens "
                    f"plus {max_new_tokens} new tokens need {need} positions, but {model_path} "
                    f"has a context of {positions} ({key} in its config.json); {fix}")


def ignored_attention_option(text: Any, longest_sequence: int) -> tuple[str, Any, str] | None:
    """(config key, value, what it is) of the first option in a (text) config
    that areno's kernels would ignore for sequences of up to `longest_sequence`
    tokens, or None. Qwen2/3 keep `sliding_window` only with use_sliding_window
    (transformers sets it to None otherwise); `layer_types` says which layers use
    a window (Mistral has none: every layer does)."""
    for key, (what, neutral) in IGNORED_MATH.items():
        value = getattr(text, key, None)
        if value not in neutral:
            return key, value, what
    layer_types = getattr(text, "layer_types", None)
    for key, (what, layer_type) in WINDOWS.items():
        window = getattr(text, key, None)
        used = layer_types is None or layer_type in layer_types
        if isinstance(window, int) and window < longest_sequence and used:
            return key, window, what
    return None


def check_attention(model_path: str, longest_prompt: int, max_new_tokens: int) -> None:
    """UserError when the model's attention or logits use an option areno's
    kernels ignore (see IGNORED_MATH, WINDOWS)."""
    text = _text_config(model_path)
    need = longest_prompt + max_new_tokens
    found = None if text is None else ignored_attention_option(text, need)
    if found is None:
        return
    key, value, what = found
    fix = (f"keep prompt + --max-new-tokens within {value} tokens (now {need})" if key in WINDOWS
           else "use a model without it")
    raise UserError(f"{model_path}: config.json sets {key} {value} ({what}), which areno's training "
                    f"kernels do not apply, so its log-probs would not be the model's; {fix}")


def check_model(model_path: str, longest_prompt: int, max_new_tokens: int) -> None:
    """Every start-up check of --ckpt's config (context, attention options)."""
    check_context(model_path, longest_prompt, max_new_tokens)
    check_attention(model_path, longest_prompt, max_new_tokens)
