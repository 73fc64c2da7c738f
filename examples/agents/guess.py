"""Guess the digit, as an agent written against the OpenAI API: the same
two-turn game as examples/guess/env.py, played through the run's gateway with
the `openai` client's completions API (the demo's 17-token tokenizer writes
digits, "+=:" and spaces only, so the agent sends text, not chat messages).

    areno train --agent-path examples/agents/guess.py --max-turns 2 --max-new-tokens 2 \\
        --ppo-epochs 2 --max-steps 80 --lr 1e-3 --reward-workers 2

The first guess is right one time in ten; a wrong one is answered with ":" and
the secret, and a right second guess still scores 1: the policy learns to copy
the secret from the conversation the agent sends back. With the command above
the mean reward goes from ~0.2 (first 10 steps) to ~0.95 (last 20) in about a
minute on 2 cores (tests/test_agent_learns.py). The agent is async, so each of
the 2 workers runs up to --agent-concurrency runs at once and the engine
generates a turn for all of them together; `task.async_client()` shares the
worker's connections (a client of its own per run costs ~50 ms to make).
"""

import hashlib


async def agent(task):
    client = task.async_client()  # an openai.AsyncOpenAI bound to this run
    h = hashlib.blake2b(f"{task.prompt}|{task.index}".encode(), digest_size=2).digest()
    secret = str(int.from_bytes(h, "little") % 10)  # fixed per (prompt, sample): a run repeats
    prompt = task.prompt
    for turn in range(2):
        out = (await client.completions.create(model=task.model, prompt=prompt)).choices[0].text
        digits = [c for c in out if c.isdigit()]
        if digits and digits[0] == secret:
            return 1.0
        prompt = prompt + out + ":" + secret  # the reply: the secret, appended as text
    return 0.0
