"""The agent gateway's cost: per call against calling the engine directly with
the same tokens, and how busy many agent runs in flight keep the engine.

    PYTHONPATH=. python scripts/bench_gateway.py --calls 8 --max-tokens 16 --repeats 3

The tiny chat model on the transformers engine generates (ignore_eos: every
call samples exactly --max-tokens tokens). An agent in a worker process makes
--calls chat calls through the `openai` client, each answered by one sampled
turn and followed by a user turn; it times each call from the client's side.

overhead: one agent run alone. The contexts the engine got are replayed
  through `engine.generate_stream` directly with the same sampling (seeded:
  the same tokens, checked), round-robin with the gateway runs.
  client   mean latency of a call as the agent sees it (HTTP, JSON, the
           chat template, the prefix check, the tool parser, the engine)
  engine   mean time of the same generate call made directly
  in the driver  the same generate call's time inside the gateway's driver
  overhead client - engine, per call; and client - the call in the driver
           (what the gateway adds around the engine: HTTP, JSON, rendering)
Every figure is the median over --repeats rounds, the scenarios round-robin.
concurrency: --runs agent runs with --workers workers, turns and eager schedule:
  T (the rollout's wall time), G (inside the engine), idle (the engine had
  nothing to generate: env/engine_idle_s), idle / T.
sync vs async: the same --runs runs on --few-workers workers (turns), a sync
  agent (one run per worker) against the same agent written with AsyncOpenAI
  under --agent-concurrency (every run in flight): the same figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

AGENT = '''
import json, time
from openai import OpenAI

def agent(task):
    client = OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Count to three."}]
    lat = []
    for k in range(task.row["calls"]):
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=task.model, messages=msgs)
        lat.append(time.perf_counter() - t0)
        msgs += [r.choices[0].message, {"role": "user", "content": "Go on."}]
    if task.row.get("out"):
        with open(f"{task.row['out']}.{task.index}", "w") as f:
            json.dump(lat, f)
    return 1.0
'''


ASYNC_AGENT = '''
from openai import AsyncOpenAI

async def agent(task):
    client = AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "Count to three."}]
    for k in range(task.row["calls"]):
        r = await client.chat.completions.create(model=task.model, messages=msgs)
        msgs += [r.choices[0].message, {"role": "user", "content": "Go on."}]
    return 1.0
'''


class Timed:
    """The engine, its generate calls timed and their contexts and tokens kept."""

    def __init__(self, engine) -> None:
        self.engine, self.max_model_len, self.calls = engine, engine.max_model_len, []

    def generate_stream(self, ids, offsets, n, sampling, min_groups=1):
        t0 = time.perf_counter()
        parts = list(self.engine.generate_stream(ids, offsets, n, sampling, min_groups=min_groups))
        self.calls.append((ids.copy(), offsets.copy(), sampling, time.perf_counter() - t0,
                           np.concatenate([p.response_ids for _, p in parts])))
        yield from parts


def rollout(engine, pool, server, tok, rows, schedule_eager: bool, max_tokens: int):
    from areno.envs.driver import EnvBounds
    from areno.envs.plugin import EnvState
    from areno.gateway.conversation import ChatRenderer
    from areno.gateway.driver import rollout_agents
    from areno.gateway.tools import ToolCallParser
    from areno.rollout.engine import SamplingConfig

    states = [EnvState("", None, None, r, i) for i, r in enumerate(rows)]
    t0 = time.perf_counter()
    out = rollout_agents(engine, pool, server, ChatRenderer(tok), ToolCallParser("none", tok), states, 1,
                         SamplingConfig(max_tokens=max_tokens, seed=1, ignore_eos=True),
                         EnvBounds(max_turns=64, eager=schedule_eager))
    return out, time.perf_counter() - t0


def overhead_once(engine, pool, server, tok, args, d: Path, r: int) -> dict:
    """One agent run alone through the gateway, then its calls straight to the engine."""
    timed = Timed(engine)
    rollout(timed, pool, server, tok, [{"calls": args.calls, "out": str(d / f"lat{r}")}], False, args.max_tokens)
    client = json.loads((d / f"lat{r}.0").read_text())
    direct = []
    for ids, off, s, _, want in timed.calls:  # the same calls, straight to the engine
        t0 = time.perf_counter()
        got = np.concatenate([p.response_ids for _, p in engine.generate_stream(ids, off, 1, s)])
        direct.append(time.perf_counter() - t0)
        assert np.array_equal(got, want), "the direct call sampled other tokens"
    return {"client_s": float(np.mean(client)), "engine_s": float(np.mean(direct)),
            "engine_in_driver_s": float(np.mean([c[3] for c in timed.calls]))}


def concurrency_once(engine, pool, server, tok, args, eager: bool) -> dict:
    res, T = rollout(engine, pool, server, tok, [{"calls": args.calls}] * args.runs, eager, args.max_tokens)
    return {"T": T, "G": res.generate_s, "idle": res.engine_idle_s, "idle/T": res.engine_idle_s / T,
            "rounds": res.rounds}


def median(rows: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in rows])) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--few-workers", type=int, default=2, help="workers of the sync vs async comparison")
    ap.add_argument("--agent-concurrency", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from areno.envs.pool import EnvPool
    from areno.gateway.app import GatewayServer
    from areno.models.tiny import tiny_model_path
    from areno.rollout.hf import HFEngine

    path = tiny_model_path("chat")
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(path, dtype="float32", device="cpu", max_model_len=2048)
    server = GatewayServer()
    with tempfile.TemporaryDirectory() as d:
        agent = Path(d) / "agent.py"
        agent.write_text(AGENT)
        over, conc = [], {"turns": [], "eager": []}
        # One pool of --workers: the overhead run uses one of them. Scenarios round-robin,
        # so a busy neighbour slows each of them alike; medians over --repeats.
        with EnvPool(str(agent), workers=args.workers, timeout=300, kind="agent") as pool:
            pool.warm()
            for r in range(args.repeats):
                over.append(overhead_once(engine, pool, server, tok, args, Path(d), r))
                for k in conc:
                    conc[k].append(concurrency_once(engine, pool, server, tok, args, k == "eager"))
        over = median(over) | {"calls": args.calls * args.repeats}
        over["overhead_s"] = over["client_s"] - over["engine_s"]
        over["overhead_share"] = over["overhead_s"] / over["client_s"]
        over["gateway_s"] = over["client_s"] - over["engine_in_driver_s"]  # HTTP, render, prefix check
        conc = {k: median(v) for k, v in conc.items()}
        modes = sync_vs_async(engine, server, tok, args, agent, Path(d) / "async_agent.py")
    server.close()
    print(f"overhead: {over['calls']} calls of {args.max_tokens} tokens, tiny chat model, transformers engine")
    print(f"  client {over['client_s'] * 1e3:8.2f} ms   engine {over['engine_s'] * 1e3:8.2f} ms   "
          f"(in the driver {over['engine_in_driver_s'] * 1e3:.2f} ms)   overhead "
          f"{over['overhead_s'] * 1e3:8.2f} ms per call ({over['overhead_share']:.0%} of a call); "
          f"outside the engine call {over['gateway_s'] * 1e3:.2f} ms")
    print(f"concurrency: {args.runs} runs x {args.calls} calls, {args.workers} workers")
    for k, m in conc.items():
        print(f"  {k:>6}: T {m['T']:6.2f} s  G {m['G']:6.2f} s  idle {m['idle']:6.2f} s  "
              f"idle/T {m['idle/T']:.2f}  generate calls {m['rounds']}")
    print(f"sync vs async: {args.runs} runs x {args.calls} calls, {args.few_workers} workers, turns")
    for k, m in modes.items():
        print(f"  {k:>6}: T {m['T']:6.2f} s  G {m['G']:6.2f} s  idle {m['idle']:6.2f} s  "
              f"idle/T {m['idle/T']:.2f}  generate calls {m['rounds']}")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, overhead=over,
                                             concurrency=conc, sync_vs_async=modes), indent=2))


def sync_vs_async(engine, server, tok, args, sync_agent: Path, async_agent: Path) -> dict:
    """The runs on a few workers: the sync agent (one run each) vs the async one
    (--agent-concurrency runs each), round-robin, medians over --repeats."""
    from areno.envs.pool import EnvPool

    async_agent.write_text(ASYNC_AGENT)
    rows: dict[str, list] = {"sync": [], "async": []}
    with EnvPool(str(sync_agent), workers=args.few_workers, timeout=300, kind="agent") as sync_pool, \
            EnvPool(str(async_agent), workers=args.few_workers, timeout=300, kind="agent",
                    concurrency=args.agent_concurrency) as async_pool:
        sync_pool.warm()
        async_pool.warm()
        for _ in range(args.repeats):
            rows["sync"].append(concurrency_once(engine, sync_pool, server, tok, args, False))
            rows["async"].append(concurrency_once(engine, async_pool, server, tok, args, False))
    return {k: median(v) for k, v in rows.items()}


if __name__ == "__main__":
    main()
