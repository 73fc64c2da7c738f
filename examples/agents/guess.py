"""Guess the digit, as an agent written against the OpenAI API: the same
two-turn game as examples/guess/env.py, played through the run's gateway with
the `openai` client's completions API (the demo's 17-token tokenizer writes
digits, "+=:" and spaces only, so the agent sends text, not chat messages).

    areno train --agent-path examples/agents/guess.py --max-turns 2 --max-steps 200 --lr 1e-3 \\
        --reward-workers 8

The first guess is right one time in ten; a wrong one is answered with ":" and
the secret, and a right second guess still scores 1: the policy learns to copy
the secret from the conversation the agent sends back. With the command above
the mean reward goes from 0.19 (first 10 steps) to 0.98 (last 20), 16 min on a
shared 2-core host (tests/test_agent_learns.py).
"""

import hashlib

from openai import OpenAI


def agent(task):
    client = OpenAI(base_url=task.base_url, api_key=task.api_key)
    h = hashlib.blake2b(f"{task.prompt}|{task.index}".encode(), digest_size=2).digest()
    secret = str(int.from_bytes(h, "little") % 10)  # fixed per (prompt, sample): a run repeats
    prompt = task.prompt
    for turn in range(2):
        out = client.completions.create(model=task.model, prompt=prompt).choices[0].text
        digits = [c for c in out if c.isdigit()]
        if digits and digits[0] == secret:
            return 1.0
        prompt = prompt + out + ":" + secret  # the reply: the secret, appended as text
    return 0.0
