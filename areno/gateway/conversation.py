"""The token-exact core of the agent gateway: a conversation the agent sends as
text, laid onto the tokens the engine sampled.

An agent sends its whole conversation with every call. The trajectory keeps
what the engine saw and sampled, token for token: the first call's rendered
prompt, then each turn's sampled tokens, and between them the observation
tokens (tool results, user turns), each tokenized once. A call *extends* the
trajectory when its messages start with the messages of an earlier call plus
the assistant message the gateway answered it with (compared after
`normalize`), and the chat template renders that history as a prefix of the
new conversation: then the sampled tokens stay as they were, and only the
rendered text after that history becomes observation tokens. Anything else
(an edited, dropped or reordered turn, changed tools, a template that rewrites
earlier turns) is a *branch*: the trajectory goes back to the deepest earlier
call the messages still extend, or, when none, starts again from the new
conversation rendered whole, as observation tokens (never trained). Either
way the abandoned turns are dropped from training and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_PLACEHOLDER = "\x00ARENO_AGENT_TURN\x00"

Message = tuple[tuple[str, Any], ...]  # a normalized message: sorted (key, value) pairs


def _text(content: Any) -> str:
    """A message's content as text: None -> "", a list of parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _arguments(args: Any) -> Any:
    """Tool-call arguments as a JSON value when they parse (so key order and
    spacing do not tell two calls apart), else the string as given."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _tool_calls(calls: Any) -> tuple:
    out = []
    for c in calls or ():
        fn = c.get("function", c) if isinstance(c, dict) else {}
        out.append((fn.get("name", ""), json.dumps(_arguments(fn.get("arguments", {})), sort_keys=True)))
    return tuple(out)


def normalize(messages: list[dict]) -> tuple[Message, ...]:
    """OpenAI-format messages -> comparable values: role, content as text, tool
    calls as (name, canonical JSON arguments), tool_call_id and name. Tool-call
    ids and fields the template never sees (refusal, audio, annotations) are left out."""
    out = []
    for m in messages:
        d = {"role": m.get("role", ""), "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            d["tool_calls"] = _tool_calls(m["tool_calls"])
        for k in ("tool_call_id", "name"):
            if m.get(k) is not None:
                d[k] = str(m[k])
        out.append(tuple(sorted(d.items())))
    return tuple(out)


def normalize_tools(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class ChatRenderer:
    """Messages (+ tools) -> text, with the tokenizer's chat template.

    A template that does not render `tool_calls` (SmolLM2's) gets each call
    written into the assistant content in the tool parser's format (hermes:
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), which is how the
    model wrote it; `tools` are passed to the template, which decides what of
    them the model sees. `end_text` is what the template writes after an
    assistant turn's content (`<|im_end|>\\n`), `eos_text` the part of it the
    model samples itself (its eos token) when a turn stops.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        if not template:
            raise ValueError("the tokenizer has no chat template: the gateway renders conversations with it")
        self.template_calls = "tool_calls" in template
        conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PLACEHOLDER}]
        text = self.render(conv, None, generation_prompt=False)
        self.end_text = text[text.index(_PLACEHOLDER) + len(_PLACEHOLDER):]
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text = eos if isinstance(eos, str) and eos and self.end_text.startswith(eos) else ""

    def _prepared(self, m: dict) -> dict:
        out = {k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls",
                                                                      "tool_call_id", "name")}
        out["content"] = _text(m.get("content"))
        calls = m.get("tool_calls")
        if calls:
            fns = [c.get("function", c) for c in calls]
            if self.template_calls:
                out["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": f.get("name"), "arguments": _arguments(f.get("arguments"))}} for c, f in zip(calls, fns)]
            else:
                out.pop("tool_calls")
                bodies = [json.dumps({"name": f.get("name"), "arguments": _arguments(f.get("arguments"))})
                          for f in fns]
                written = "".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
                out["content"] = out["content"] + written
        return out

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        conv = [self._prepared(m) for m in messages]
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def tokens(self, text: str) -> np.ndarray:
        """[k] int32: text tokenized once, no special tokens added (the template wrote them)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return np.asarray(ids, dtype=np.int32)


@dataclass(frozen=True)
class _Anchor:
    """A point the trajectory can be extended from: the conversation up to and
    including an answered turn, and how many segments it held then."""

    messages: tuple[Message, ...]  # the call's messages + the assistant message answered
    tools: str
    segments: int
    stopped: bool  # the turn ended with eos (the template's end marker was sampled)
    text: str | None = None  # /v1/completions: the prompt + the completion returned


@dataclass(frozen=True)
class Extension:
    """What a call did to the trajectory: the observation tokens appended, whether
    it branched (turns dropped), and how many sampled turns it dropped."""

    observation: np.ndarray  # [k] int32
    branched: bool
    dropped_turns: int
    rebased: bool  # no earlier call matched: the whole conversation became observation tokens


@dataclass
class AgentTrajectory:
    """One agent run's tokens: `base` (the first call's rendered prompt, or the
    conversation a rebase rendered whole), then segments of sampled (mask 1)
    and observation (mask 0) tokens. O(turns) arrays, no object per token."""

    renderer: ChatRenderer
    base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    anchors: list[_Anchor] = field(default_factory=list)
    first: tuple[tuple[Message, ...], str] | None = None  # the base call's (messages, tools)
    branches: int = 0
    dropped_turns: int = 0

    @property
    def turns(self) -> int:
        return sum(self.masks)

    @property
    def length(self) -> int:
        """Response tokens so far (sampled + observation), the base excluded."""
        return sum(a.size for a in self.ids)

    def context(self) -> np.ndarray:
        """[L] int32: what the engine sees for the next turn (base, then every segment)."""
        return np.concatenate([self.base, *self.ids]).astype(np.int32, copy=False)

    def request(self, messages: list[dict], tools: list[dict] | None) -> Extension:
        """Lay a call's conversation onto the trajectory (see the module doc)."""
        norm, tnorm = normalize(messages), normalize_tools(tools)
        full = self.renderer.render(messages, tools, generation_prompt=True)
        for k in range(len(self.anchors) - 1, -1, -1):
            a = self.anchors[k]
            if a.tools != tnorm or len(norm) <= len(a.messages) or norm[:len(a.messages)] != a.messages:
                continue
            # the call's own copy of the history (equal to the anchor's once normalized):
            # the template renders it as the prefix of the whole call, or does not
            history = self.renderer.render(messages[:len(a.messages)], tools, generation_prompt=False)
            end = self.renderer.end_text
            if not (full.startswith(history) and history.endswith(end)):
                break  # the template rewrites earlier turns: no prefix to keep
            dropped = self._truncate(a.segments, k + 1)
            tail = end[len(self.renderer.eos_text):] if a.stopped else end
            obs = self.renderer.tokens(tail + full[len(history):])
            self._append(obs, np.zeros(obs.size, np.float32), 0)
            return Extension(obs, dropped > 0, dropped, False)
        if self.first is not None and self.first == (norm, tnorm):  # the first call again
            dropped = self._truncate(0, 0)
            return Extension(np.zeros(0, np.int32), dropped > 0, dropped, False)
        rebased = self.first is not None
        dropped = self._truncate(0, 0)
        self.base = self.renderer.tokens(full)
        self.first = (norm, tnorm)
        if rebased:
            self.branches += dropped == 0  # a rebase with nothing sampled yet still branched
        return Extension(self.base, rebased, dropped, rebased)

    def request_text(self, prompt: str) -> Extension:
        """/v1/completions: a prompt extends the trajectory when it starts with an
        earlier prompt plus the completion returned for it; only the rest is
        tokenized. Otherwise a branch, as for chat (see request)."""
        for k in range(len(self.anchors) - 1, -1, -1):
            a = self.anchors[k]
            if a.text is None or len(prompt) <= len(a.text) or not prompt.startswith(a.text):
                continue
            dropped = self._truncate(a.segments, k + 1)
            obs = self.renderer.tokens(prompt[len(a.text):])
            self._append(obs, np.zeros(obs.size, np.float32), 0)
            return Extension(obs, dropped > 0, dropped, False)
        key = ((("prompt", prompt),),), ""
        if self.first is not None and self.first == key:
            dropped = self._truncate(0, 0)
            return Extension(np.zeros(0, np.int32), dropped > 0, dropped, False)
        rebased = self.first is not None
        dropped = self._truncate(0, 0)
        self.base, self.first = self.renderer.tokens(prompt), key
        if rebased:
            self.branches += dropped == 0
        return Extension(self.base, rebased, dropped, rebased)

    def answer_text(self, prompt: str, completion: str, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Record a sampled completion of /v1/completions (see answer)."""
        self._append(np.asarray(ids, np.int32), np.asarray(logprobs, np.float32), 1)
        self.anchors.append(_Anchor((), "", len(self.ids), False, prompt + completion))

    def answer(self, messages: list[dict], tools: list[dict] | None, reply: dict,
               ids: np.ndarray, logprobs: np.ndarray, stopped: bool) -> None:
        """Record a sampled turn ([k] int32 ids, [k] float32 log-probs) and the
        assistant message it was answered with, as an anchor for the next call."""
        self._append(np.asarray(ids, np.int32), np.asarray(logprobs, np.float32), 1)
        self.anchors.append(_Anchor(normalize(list(messages) + [reply]), normalize_tools(tools), len(self.ids),
                                    stopped))

    def _append(self, ids: np.ndarray, lps: np.ndarray, mask: int) -> None:
        if ids.size:
            self.ids.append(ids)
            self.logprobs.append(lps)
            self.masks.append(mask)

    def _truncate(self, segments: int, anchors: int) -> int:
        """Keep the first `segments` segments and `anchors` anchors; -> sampled turns dropped."""
        dropped = sum(self.masks[segments:])
        del self.ids[segments:], self.logprobs[segments:], self.masks[segments:], self.anchors[anchors:]
        if dropped:
            self.branches += 1
            self.dropped_turns += dropped
        return dropped

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [T] int32, log-probs [T] float32, mask [T] uint8) after the base."""
        if not self.ids:
            return np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.uint8)
        mask = np.repeat(np.asarray(self.masks, np.uint8), [a.size for a in self.ids])
        return np.concatenate(self.ids), np.concatenate(self.logprobs), mask


def common_prefix(rows: list[np.ndarray]) -> int:
    """The length of the longest common prefix of int arrays (a group's bases)."""
    if not rows:
        return 0
    n = min(r.size for r in rows)
    same = np.ones(n, bool)
    for r in rows[1:]:
        same &= rows[0][:n] == r[:n]
    return int(n if same.all() else np.argmin(same))
