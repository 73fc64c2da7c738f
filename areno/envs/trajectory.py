"""Trajectories as flat arrays: the tokens the engine sampled, turn after turn,
with each observation's tokens between them, and the mask telling them apart.

Token in, token out: a trajectory only ever grows by appending arrays (a turn's
sampled tokens as the engine returned them, an observation tokenized once), so
no earlier turn is decoded and tokenized again. Python holds O(turns) arrays
per trajectory, never an object per token; `to_batch` is one concatenate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from areno.rollout.batch import RolloutBatch, offsets_from_lengths

_ASSISTANT = "\x00ARENO_ASSISTANT\x00"
_OBSERVATION = "\x00ARENO_OBSERVATION\x00"


class ObservationFormat:
    """How an observation becomes tokens after a turn.

    With a chat template: the text the template puts between an assistant turn's
    content and the next user turn's content (the end-of-turn marker, the user
    header), the observation, then what follows a user turn up to the next
    generation prompt. Both pieces are read once from a placeholder conversation.
    When the sampled turn already ended with the end-of-turn token (it stopped),
    that marker is not repeated. Without a template: the observation text alone.
    """

    def __init__(self, tokenizer: Any, use_chat_template: bool, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        self.eos_ids = frozenset(int(e) for e in eos_token_ids)
        self.between, self.after, self.eos_text = "", "", ""
        self._max_token_bytes: int | None = None  # min_tokens's divisor, read from the vocabulary once
        if self.chat:
            conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT},
                    {"role": "user", "content": _OBSERVATION}]
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            a, o = text.index(_ASSISTANT) + len(_ASSISTANT), text.index(_OBSERVATION)
            self.between, self.after = text[a:o], text[o + len(_OBSERVATION):]
            # the end-of-turn text the template writes, if the stopped turn sampled it
            for e in sorted(self.eos_ids):
                t = tokenizer.convert_ids_to_tokens(e)
                if isinstance(t, str) and t and self.between.startswith(t):
                    self.eos_text = t
                    break

    def text(self, observation: str, stopped: bool) -> str:
        """The observation's text as appended after a turn (stopped: it ended with eos)."""
        if not self.chat:
            return observation
        between = self.between[len(self.eos_text):] if stopped and self.eos_text else self.between
        return between + observation + self.after

    def min_tokens(self, observation: str) -> int:
        """A lower bound on the observation's tokens, from its UTF-8 bytes over the
        most bytes any vocabulary entry spells (its text as stored, which never
        decodes to more): a 1 MB observation is refused without tokenizing it
        (BPE over one long word is quadratic: minutes)."""
        if self._max_token_bytes is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._max_token_bytes = max((len(t.encode()) for t in vocab), default=0) or 1 << 30
        return -(-len(observation.encode()) // self._max_token_bytes)

    def tokens(self, observation: str, last_token: int) -> np.ndarray:
        """[k] int32: the observation tokenized once (last_token: the turn's last sampled token)."""
        text = self.text(observation, stopped=int(last_token) in self.eos_ids)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return np.asarray(ids, dtype=np.int32)


class Trajectories:
    """N trajectories growing turn by turn; trajectory i answers prompt group_index[i].

    prompt_ids / prompt_offsets: [sum P lens] int32 / [P+1] int64 (the rollout's prompts).
    """

    def __init__(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, group_index: np.ndarray) -> None:
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        self.prompt_offsets = np.asarray(prompt_offsets, dtype=np.int64)
        self.group_index = np.asarray(group_index, dtype=np.int64)
        n = self.group_index.size
        self._ids: list[list[np.ndarray]] = [[] for _ in range(n)]
        self._lps: list[list[np.ndarray]] = [[] for _ in range(n)]
        self._masks: list[list[np.ndarray]] = [[] for _ in range(n)]
        # int32 weight version per token, while every turn came with one (engine.weight_version set)
        self._vers: list[list[np.ndarray]] | None = [[] for _ in range(n)]
        self.length = np.zeros(n, dtype=np.int64)  # response tokens so far (sampled + observed)
        self.turns = np.zeros(n, dtype=np.int64)

    def __len__(self) -> int:
        return self.group_index.size

    def add_turn(self, i: int, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray | None = None) -> None:
        """Append turn tokens [k] int32 exactly as sampled, with their [k] float32
        log-probs and [k] int32 weight versions (None: the engine was not told one,
        and the batch carries none)."""
        ids = np.asarray(ids, np.int32)
        if versions is None:
            self._vers = None
        elif self._vers is not None:
            self._vers[i].append(np.asarray(versions, np.int32))
        self._append(i, ids, np.asarray(logprobs, np.float32), 1)
        self.turns[i] += 1

    def extend_turn(self, i: int, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray | None = None) -> None:
        """Append tokens to trajectory i's last turn (a turn halted mid-generation,
        continued on resume: envs/resume.py), as add_turn without counting a turn."""
        self.add_turn(i, ids, logprobs, versions)
        self.turns[i] -= 1

    def restore(self, i: int, ids: np.ndarray, logprobs: np.ndarray, mask: np.ndarray,
                versions: np.ndarray | None, turns: int) -> None:
        """Trajectory i (empty) as saved: [k] int32 tokens, [k] float32 log-probs,
        [k] uint8 mask, [k] int32 versions (None: none recorded), its turns."""
        if versions is None:
            self._vers = None
        elif self._vers is not None:
            self._vers[i].append(np.asarray(versions, np.int32))
        self._append(i, np.asarray(ids, np.int32), np.asarray(logprobs, np.float32), 0)
        self._masks[i][-1] = np.asarray(mask, np.uint8)
        self.turns[i] = turns

    def tail(self, i: int, k: int) -> np.ndarray:
        """[k] int32: trajectory i's last k tokens."""
        return np.concatenate(self._ids[i])[self.length[i] - k:] if k else np.zeros(0, np.int32)

    def add_observation(self, i: int, ids: np.ndarray) -> None:
        """Append observation tokens [k] int32 (log-prob 0, mask 0: not trained; their
        version, which no lag counts, the last sampled token's)."""
        ids = np.asarray(ids, np.int32)
        if self._vers is not None:
            last = next((int(v[-1]) for v in reversed(self._vers[i]) if v.size), 0)
            self._vers[i].append(np.full(ids.size, last, np.int32))
        self._append(i, ids, np.zeros(ids.size, np.float32), 0)

    def _append(self, i: int, ids: np.ndarray, lps: np.ndarray, m: int) -> None:
        assert ids.shape == lps.shape and ids.ndim == 1, (ids.shape, lps.shape)
        self._ids[i].append(ids)
        self._lps[i].append(lps)
        self._masks[i].append(np.full(ids.size, m, np.uint8))
        self.length[i] += ids.size

    def prompt(self, i: int) -> np.ndarray:
        g = self.group_index[i]
        return self.prompt_ids[self.prompt_offsets[g]:self.prompt_offsets[g + 1]]

    def context(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next turn's prompts of trajectories idx: each its prompt then its
        trajectory so far, as CSR (ids [sum] int32, offsets [len(idx)+1] int64)."""
        pieces = [a for i in idx.tolist() for a in (self.prompt(i), *self._ids[i])]
        lengths = self.prompt_offsets[self.group_index[idx] + 1] - self.prompt_offsets[self.group_index[idx]]
        lengths = lengths + self.length[idx]
        ids = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        return ids.astype(np.int32, copy=False), offsets_from_lengths(lengths)

    def segments(self, i: int) -> list[tuple[int, np.ndarray]]:
        """Trajectory i as (mask value, token ids) pieces, in order (display, tests)."""
        return [(int(m[0]) if m.size else 1, a) for a, m in zip(self._ids[i], self._masks[i])]

    def to_batch(self, finish_reason: np.ndarray, turn_cut: np.ndarray) -> RolloutBatch:
        """Every trajectory as one RolloutBatch response, with response_mask, turn_cut
        ([N] bool: its last turn was cut at its token cap) and, when every turn
        came with versions, token_version (a trajectory's turns may span several)."""
        def cat(parts: list[list[np.ndarray]], dtype: type) -> np.ndarray:
            flat = [a for p in parts for a in p]
            return np.concatenate(flat).astype(dtype, copy=False) if flat else np.zeros(0, dtype)
        return RolloutBatch(
            prompt_ids=self.prompt_ids, prompt_offsets=self.prompt_offsets,
            response_ids=cat(self._ids, np.int32), response_offsets=offsets_from_lengths(self.length),
            response_logprobs=cat(self._lps, np.float32), group_index=self.group_index,
            finish_reason=np.asarray(finish_reason, dtype=np.uint8), response_mask=cat(self._masks, np.uint8),
            turn_cut=np.asarray(turn_cut, dtype=bool),
            token_version=None if self._vers is None else cat(self._vers, np.int32),
        )
