"""GSM8K reward with math-verify: 1.0 if the completion's final answer equals
the reference answer, else 0.0 (use with --reward-fn-path).

The reference is `record.answer`: the GSM8K final answer (the text after
"####"; dataset_loader.py and areno's default GSM8K normalization both put it
there). From the completion we take the text after its last "####" if it has
one, else the whole completion, and let math-verify find the answer in it
(\\boxed{...}, "the answer is ...", the last number, LaTeX).

Timeouts: math-verify limits each parse/verify with SIGALRM, which works only
in a process's main thread. areno's reward workers call reward_fn in their
main thread, so the limit below applies there (and areno's --reward-timeout
kills the worker as the backstop). Called from another thread (e.g.
--reward-workers 0 inside a threaded caller) the signal cannot be used, so we
pass no limit rather than have math-verify raise.
"""

import threading

from math_verify import parse, verify

PARSE_TIMEOUT_S = 3


def _limit():
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _final_part(completion: str) -> str:
    if "####" in completion:
        tail = completion.rsplit("####", 1)[-1].strip()
        return tail.splitlines()[0] if tail else tail
    return completion


def reward_fn(record) -> float:
    if not record.answer or not record.completion:
        return 0.0
    limit = _limit()
    gold = parse(record.answer.replace(",", ""), parsing_timeout=limit)
    pred = parse(_final_part(record.completion), parsing_timeout=limit)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=limit) else 0.0
