"""What --ckpt's config.json says about the model, read before any engine starts.

vLLM refuses a `max_model_len` beyond the model's context with a long pydantic
traceback, and transformers' generate runs past it silently; so the controller
compares prompt length + --max-new-tokens with the context first and reports a
mistake as one line.
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


def context_length(model_path: str) -> tuple[int, str] | None:
    """(positions, config key) the model accepts, or None when its config does not
    say (or is not readable here, or RoPE scaling changes it)."""
    try:
        from transformers import AutoConfig

        cfg: Any = AutoConfig.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - unknown architectures are the engine's to judge
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
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
