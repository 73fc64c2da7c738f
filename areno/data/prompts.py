"""Normalized rows -> rendered prompts -> flat token arrays (PromptSet, CSR).

    prompts = tokenize_prompts(rows, tok, max_prompt_len=512)  # PromptSet
    sampler = PromptSampler(len(prompts), batch_size=64, seed=0)  # sampler.py
    ids, offsets = select(prompts, sampler.next_batch())

Rendering and tokenizing are O(rows) Python done once at startup (one batched
tokenizer call); the per-step path (`select`) is a few vectorized numpy calls,
with no per-token Python.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from areno.errors import UserError, one_line
from areno.rollout.batch import csr_take, offsets_from_lengths


@dataclass(frozen=True, repr=False)
class PromptSet:
    """Rendered, tokenized prompts in CSR layout.

    ids:        [sum lens] int32, every prompt's tokens concatenated
    offsets:    [P+1] int64, prompt p is ids[offsets[p]:offsets[p+1]]
    row_index:  [P] int64, the RowSet row prompt p came from
    texts:      P rendered prompt strings (what the model sees)
    """

    ids: np.ndarray
    offsets: np.ndarray
    row_index: np.ndarray
    texts: list[str]
    max_prompt_len: int
    dropped_overlong: int = 0  # prompts longer than max_prompt_len tokens
    dropped_empty: int = 0  # prompts that rendered to zero tokens

    def __post_init__(self) -> None:
        assert self.ids.dtype == np.int32 and self.offsets.dtype == np.int64, (self.ids.dtype, self.offsets.dtype)
        assert self.offsets[-1] == self.ids.size and self.row_index.size == len(self.texts) == self.offsets.size - 1

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __repr__(self) -> str:
        return (
            f"PromptSet({len(self)} prompts, {self.ids.size} tokens, max_prompt_len="
            f"{self.max_prompt_len}, dropped_overlong={self.dropped_overlong}, "
            f"dropped_empty={self.dropped_empty})"
        )

    @property
    def lengths(self) -> np.ndarray:
        """[P] int64"""
        return np.diff(self.offsets)


def _conversation(prompt: Any, system_prompt: str | None) -> list[dict]:
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def _chat_texts(rows: Sequence[dict], tokenizer: Any, system_prompt: str | None) -> list[str]:
    """Each row's prompt through the tokenizer's chat template, the assistant turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the tokenizer has no chat template: pass --no-chat-template for "
            "plain-text prompts, or use a tokenizer that has one"
        )
    convs = [_conversation(r["prompt"], system_prompt) for r in rows]
    try:
        return list(tokenizer.apply_chat_template(convs, tokenize=False, add_generation_prompt=True))
    except Exception:  # noqa: BLE001 - find the row that broke the template
        for i, conv in enumerate(convs):
            try:
                tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001
                raise UserError(f"row {i}: field 'prompt': the chat template failed on it: {one_line(e)}") from None
        raise


def _plain_texts(rows: Sequence[dict], system_prompt: str | None) -> list[str]:
    """Each row's prompt string as is, after system_prompt and a blank line if given."""
    texts = []
    for i, r in enumerate(rows):
        if not isinstance(r["prompt"], str):
            raise UserError(
                f"row {i}: field 'prompt' is a list of chat messages but --no-chat-template is set"
            )
        texts.append(f"{system_prompt}\n\n{r['prompt']}" if system_prompt else r["prompt"])
    return texts


def tokenize_prompts(
    rows: Sequence[dict],
    tokenizer: Any,
    *,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
    max_prompt_len: int,
) -> PromptSet:
    """Render every prompt, tokenize them in one batched call, store them flat.

    Rendering (PromptSet.texts), with the chat template: a string prompt becomes
    one user message; `system_prompt` is prepended unless the messages already
    start with a system message; the assistant turn is opened
    (add_generation_prompt=True). Plain text: the prompt string as is, after
    `system_prompt` and a blank line if given.

    Prompts with more than `max_prompt_len` tokens, or none, are dropped and
    counted; a UserError if none is left. A chat-rendered prompt is tokenized
    without adding special tokens (the template holds them); plain text gets the
    tokenizer's usual special tokens (e.g. BOS).
    """
    if max_prompt_len < 1:
        raise UserError(f"--max-prompt-len must be >= 1, got {max_prompt_len}")
    texts = _chat_texts(rows, tokenizer, system_prompt) if use_chat_template else _plain_texts(rows, system_prompt)
    enc = tokenizer(texts, add_special_tokens=not use_chat_template)["input_ids"]
    lengths = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
    flat = np.fromiter(itertools.chain.from_iterable(enc), dtype=np.int32, count=int(lengths.sum()))
    empty = lengths == 0
    overlong = lengths > max_prompt_len
    keep = ~(empty | overlong)
    if not keep.any() and not overlong.any():
        raise UserError(f"every prompt is empty ({lengths.size} rows give no tokens"
                        f"{' with --no-chat-template' if not use_chat_template else ''}): check "
                        "the dataset's prompt field")
    if not keep.any():
        raise UserError(
            f"no prompt fits --max-prompt-len={max_prompt_len}: {int(overlong.sum())} of "
            f"{lengths.size} prompts are longer (shortest {int(lengths[~empty].min()) if (~empty).any() else 0} tokens), "
            f"{int(empty.sum())} are empty; raise --max-prompt-len"
        )
    kept = np.flatnonzero(keep)
    return PromptSet(
        ids=flat[np.repeat(keep, lengths)],
        offsets=offsets_from_lengths(lengths[keep]),
        row_index=kept.astype(np.int64),
        texts=[texts[i] for i in kept],
        max_prompt_len=int(max_prompt_len),
        dropped_overlong=int(overlong.sum()),
        dropped_empty=int(empty.sum()),
    )


def select(prompt_set: PromptSet, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat tokens of prompts `idx` ([B] int): ([sum lens] int32, [B+1] int64), one gather."""
    return csr_take(prompt_set.ids, prompt_set.offsets, idx)
