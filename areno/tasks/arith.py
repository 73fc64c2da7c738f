"""The embedded demo task: one-digit addition, `a+b=` with a+b < 10 (55 prompts).

Reward, dense enough that a random policy over a ~17-token vocabulary sometimes
succeeds and GRPO can climb (DESIGN.md, "embedded default"):
  1.0  the right digit, then end of sequence
  0.5  the right digit, then anything else
  0.0  otherwise
"""

from __future__ import annotations


def rows() -> list[dict]:
    """The 55 prompts as normalized dataset rows."""
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
        if a + b < 10
    ]


def reward_fn(record) -> float:
    text = record.completion.strip()
    if not text or text[0] != record.answer:
        return 0.0
    return 1.0 if len(text) == 1 and record.finish_reason == "stop" else 0.5
