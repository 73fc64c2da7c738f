"""Multi-turn concurrency (issue 28, 7): an environment that sleeps per step,
with a fixed and a heavy-tailed delay; does the engine keep generating the
other trajectories while some wait?

    PYTHONPATH=. python scripts/bench_env_concurrency.py --trajectories 8 --turns 3

The tiny chat model on the transformers engine generates; the env sleeps
(fixed: --delay s every step; heavy-tailed: Pareto(alpha 1.5) scaled to the
same mean, capped at 10x) in --workers processes. Per scenario it reports, for
one rollout (mean over --repeats):

  T      the rollout's wall time
  G      time inside the engine's generate calls
  idle   time the engine waited with nothing to generate (env/engine_idle_s)
  chain  the slowest single trajectory's summed env delays
  serial the summed env delays of every trajectory (a driver stepping envs one by one)

and the ratios idle / T, T / (G + chain) (1 is the ideal: generation plus the
slowest chain), T / (G + serial) (how much below running the envs one by one).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

ENV = '''
import random, time
def reset(state):
    state.data["slept"] = 0.0
    state.data["rng"] = random.Random(state.index * 7919 + state.row.get("seed", 0)).random()
def step(state, completion):
    rng = random.Random(state.data["rng"] + state.turn)
    mean, kind = state.row["delay"], state.row["kind"]
    if kind == "fixed":
        d = mean
    else:  # Pareto(1.5) has mean 3 x_m: scale to the same mean, cap the tail at 10x
        d = min(mean / 3.0 * rng.paretovariate(1.5), 10 * mean)
    time.sleep(d)
    state.data["slept"] += d
    return "Go on.", 1.0, False
'''


def scenario(engine, tok, env_path: str, kind: str, args) -> dict:
    from areno.envs.driver import EnvBounds, rollout_multiturn
    from areno.envs.plugin import EnvState
    from areno.envs.pool import EnvPool
    from areno.envs.trajectory import ObservationFormat
    from areno.rollout.engine import SamplingConfig

    text = tok.apply_chat_template([{"role": "user", "content": "Count to three."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = np.array(tok(text, add_special_tokens=False)["input_ids"], np.int32)
    fmt = ObservationFormat(tok, True, engine.eos_token_ids)
    rows = []
    with EnvPool(env_path, workers=args.workers, timeout=60) as pool:
        pool.warm()
        for r in range(args.repeats):
            n = args.trajectories
            states = [EnvState(text, None, None, {"delay": args.delay, "kind": kind, "seed": r}, i) for i in range(n)]
            t0 = time.perf_counter()
            out = rollout_multiturn(engine, pool, tok, fmt, ids, np.array([0, ids.size]), states, n,
                                    SamplingConfig(max_tokens=args.max_tokens, seed=r, ignore_eos=True),
                                    EnvBounds(max_turns=args.turns))
            T = time.perf_counter() - t0
            slept = np.array([s.data["slept"] for s in states])
            rows.append(dict(T=T, G=out.generate_s, idle=out.engine_idle_s, chain=float(slept.max()),
                             serial=float(slept.sum())))
    m = {k: float(np.mean([x[k] for x in rows])) for k in rows[0]}
    m |= {"idle/T": m["idle"] / m["T"], "T/(G+chain)": m["T"] / (m["G"] + m["chain"]),
          "T/(G+serial)": m["T"] / (m["G"] + m["serial"])}
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--delay", type=float, default=0.2, help="mean env step delay, seconds")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from areno.models.tiny import tiny_model_path
    from areno.rollout.hf import HFEngine

    path = tiny_model_path("chat")
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, dtype="float32", device="cpu", max_model_len=1024)
    with tempfile.TemporaryDirectory() as d:
        env_path = str(Path(d) / "sleepy_env.py")
        Path(env_path).write_text(ENV)
        res = {kind: scenario(engine, tok, env_path, kind, args) for kind in ("fixed", "heavy-tailed")}
    cols = ["T", "G", "idle", "chain", "serial", "idle/T", "T/(G+chain)", "T/(G+serial)"]
    print(f"{args.trajectories} trajectories x {args.turns} turns, {args.workers} env workers, "
          f"mean delay {args.delay} s")
    print(f"{'scenario':>13} " + " ".join(f"{c:>12}" for c in cols))
    for kind, m in res.items():
        print(f"{kind:>13} " + " ".join(f"{m[c]:12.3f}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, results=res), indent=2))


if __name__ == "__main__":
    main()
