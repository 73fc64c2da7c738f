"""Guess the digit: a two-turn game the embedded demo's tiny model masters on CPU.

    areno train --env-path examples/guess/env.py --max-turns 2 --max-steps 200 --lr 1e-3 --reward-workers 0

(the tiny demo model; --reward-workers 0 steps the env in the controller, which
suits a game this cheap; the mean reward passes 0.9 near step 100, tests/test_env_learns.py)

Each trajectory has a secret digit the prompt does not show. The first guess
is right one time in ten; a wrong one is answered with ":" and the secret, and
a right second guess still scores 1. So the reward climbs from ~0.1 to ~1 only
by reading the environment's answer: the policy must learn to copy it.
The demo's tokenizer writes digits, "+=:" and spaces only, hence the reply's form.
"""

import hashlib


def reset(state):
    # Fixed per (prompt, sample): a run repeats; the prompt alone cannot tell it.
    h = hashlib.blake2b(f"{state.prompt}|{state.index}".encode(), digest_size=2).digest()
    state.data["secret"] = str(int.from_bytes(h, "little") % 10)


def step(state, completion):
    digits = [c for c in completion if c.isdigit()]
    right = bool(digits) and digits[0] == state.data["secret"]
    if right or state.turn >= 1:
        return "", float(right), True
    return ":" + state.data["secret"], 0.0, False
