"""Per-step hand-off of a SplitPack from the controller to R ranks: shared memory
(areno.backend.handoff) vs a pickled-lists reference, measured in the same run.

    python scripts/bench_handoff.py                   # ~1M tokens, 2 and 8 ranks
    python scripts/bench_handoff.py --tokens 200000 --ranks 2 --repeats 3

For each transport and rank count, R processes (spawn, one gloo group) receive
their share of the same pack, build tensors from it and checksum every field
(so every byte is really read), then enter an all_reduce. Reported, median
over --repeats steps:

  controller_s  controller work per step: shm = copy the pack into the segment
                and send each rank its RankHandoff; pickle = turn each rank's
                share into per-sequence Python lists (what list-based trainers
                hold) and send them through a Pipe.
  ready_s       from the start of the step until the LAST rank has its tensors
                checksummed (the hand-off as the step sees it).
  first_wait_s  how long the first rank to arrive at the first collective waits
                in it, i.e. max over ranks of (all_reduce done - arrival): GPU
                time every early rank would idle.
  first_step_s  ready_s of the first step (shm: includes creating the segment).

Ranks only map/unpickle and checksum: no model. With 8 ranks on a small CPU the
ranks share cores, which slows both transports alike; compare the ratios.
Writes JSON to --out (default bench_results/handoff.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from areno.backend.handoff import LocalPack, PackWriter
from areno.pack import PACKED_TOKEN_FIELDS
from areno.rollout.batch import RolloutBatch, offsets_from_lengths
from areno.split import SplitPack, build_split_pack

FIELDS = PACKED_TOKEN_FIELDS  # per-token fields


def make_split(tokens: int, world_size: int, seed: int = 0) -> SplitPack:
    """~`tokens` positions: 8 samples per prompt, prompts ~256, responses 200..3000."""
    rng = np.random.default_rng(seed)
    n_per, p_mean, r_lo, r_hi = 8, 256, 200, 3000
    per_seq = p_mean + (r_lo + r_hi) / 2
    P = max(1, int(tokens / per_seq / n_per))
    p_len = rng.integers(p_mean // 2, p_mean * 3 // 2, P)
    r_len = rng.integers(r_lo, r_hi, P * n_per)
    T = int(r_len.sum())
    batch = RolloutBatch(
        prompt_ids=rng.integers(0, 150_000, int(p_len.sum())).astype(np.int32),
        prompt_offsets=offsets_from_lengths(p_len),
        response_ids=rng.integers(0, 150_000, T).astype(np.int32),
        response_offsets=offsets_from_lengths(r_len),
        response_logprobs=(-rng.random(T)).astype(np.float32),
        group_index=np.repeat(np.arange(P), n_per).astype(np.int64),
        finish_reason=np.zeros(P * n_per, np.uint8),
    )
    adv = rng.standard_normal(P * n_per).astype(np.float32)
    return build_split_pack(batch, adv, world_size=world_size, max_tokens=16384, num_minibatches=4)


def checksum(fields: dict[str, torch.Tensor]) -> float:
    return float(sum(t.to(torch.float64).sum() for t in fields.values()))


def rank_main(rank: int, world: int, port: int, conn) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    conn.send("up")
    while True:
        msg = conn.recv()  # the pickle reference unpickles its lists here
        if msg is None:
            break
        kind, data = msg
        if kind == "shm":
            local = LocalPack(data)
            fields = {f: getattr(local.pack, f) for f in FIELDS}
        else:  # per-sequence lists -> tensors, as a list-based trainer does
            dtypes = data.pop("_dtypes")
            fields = {f: torch.tensor([t for seq in seqs for t in seq], dtype=getattr(torch, dtypes[f]))
                      for f, seqs in data.items()}
        cs = checksum(fields)
        t_ready = time.monotonic()
        x = torch.ones(1)
        t_arrive = time.monotonic()
        dist.all_reduce(x)
        t_done = time.monotonic()
        del fields
        if kind == "shm":
            del local
        conn.send((t_ready, t_arrive, t_done, cs))
    dist.destroy_process_group()


def pickle_payloads(split: SplitPack) -> list[dict]:
    """Per rank: {field: [per-sequence list of Python numbers]} (the reference)."""
    out = []
    cu = split.pack.cu_seqlens.numpy()
    for r in range(split.world_size):
        s0, s1 = split.rank_seq_range(r)
        d: dict = {"_dtypes": {f: str(getattr(split.pack, f).dtype).removeprefix("torch.") for f in FIELDS}}
        for f in FIELDS:
            arr = getattr(split.pack, f).numpy()
            d[f] = [arr[cu[s]:cu[s + 1]].tolist() for s in range(s0, s1)]
        out.append(d)
    return out


def run(world: int, split: SplitPack, repeats: int) -> dict:
    import torch.multiprocessing as mp

    from areno.backend.controller import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    conns, procs = [], []
    for r in range(world):
        a, b = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(r, world, port, b), daemon=True)
        p.start()
        conns.append(a)
        procs.append(p)
    for c in conns:
        assert c.recv() == "up"
    writer = PackWriter("bench")
    expect = [checksum({f: getattr(split.pack, f)[int(split.pack.cu_seqlens[a]):int(split.pack.cu_seqlens[b])]
                        for f in FIELDS}) for a, b in (split.rank_seq_range(r) for r in range(world))]
    results = {}
    try:
        for kind in ("shm", "pickle"):
            rows = []
            for _ in range(repeats):
                t0 = time.monotonic()
                if kind == "shm":
                    msgs = writer.write(split)
                else:
                    msgs = pickle_payloads(split)
                for c, m in zip(conns, msgs):
                    c.send((kind, m))
                t_sent = time.monotonic()
                replies = [c.recv() for c in conns]
                for (_, _, _, cs), want in zip(replies, expect):
                    assert abs(cs - want) <= 1e-6 * max(1.0, abs(want)), (kind, cs, want)
                rows.append({
                    "controller_s": t_sent - t0,
                    "ready_s": max(r[0] for r in replies) - t0,
                    "first_wait_s": max(r[2] - r[1] for r in replies),
                })
                del msgs
            results[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            results[kind]["first_step_s"] = rows[0]["ready_s"]
            results[kind]["steps"] = rows
        results["segment_creations"] = writer.grew
    finally:
        for c in conns:
            c.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        writer.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="approximate positions per step")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_results/handoff.json")
    args = ap.parse_args(argv)
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "torch": torch.__version__},
              "tokens_requested": args.tokens, "repeats": args.repeats, "runs": {}}
    header = (f"{'ranks':>5} {'transport':>9} {'controller ms':>14} {'ready ms':>9} "
              f"{'first-coll wait ms':>19} {'first step ms':>14}")
    lines = [header]
    for world in args.ranks:
        split = make_split(args.tokens, world)
        res = run(world, split, args.repeats)
        res["tokens"] = split.pack.num_tokens
        res["bytes_per_step"] = sum(getattr(split.pack, f).numel() * getattr(split.pack, f).element_size()
                                    for f in FIELDS)
        for kind in ("shm", "pickle"):
            r = res[kind]
            lines.append(f"{world:>5} {kind:>9} {r['controller_s'] * 1e3:>14.1f} {r['ready_s'] * 1e3:>9.1f} "
                         f"{r['first_wait_s'] * 1e3:>19.1f} {r['first_step_s'] * 1e3:>14.1f}")
        res["ratio_ready_pickle_over_shm"] = res["pickle"]["ready_s"] / res["shm"]["ready_s"]
        res["ratio_first_wait_pickle_over_shm"] = res["pickle"]["first_wait_s"] / max(res["shm"]["first_wait_s"], 1e-9)
        lines.append(f"{'':>5} {'ratio':>9} pickle/shm: ready x{res['ratio_ready_pickle_over_shm']:.1f}, "
                     f"first-collective wait x{res['ratio_first_wait_pickle_over_shm']:.1f} "
                     f"({split.pack.num_tokens:,} tokens, {res['bytes_per_step'] / 1e6:.0f} MB)")
        report["runs"][str(world)] = res
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
