"""The simulated parts of bench_longcot's step: a rollout engine returning
precomputed responses on a modelled timeline, a reward plugin whose cost the
bench sets between modes, and the prompt dataset.

SyntheticEngine: precomputed responses per prompt (P x n, lengths around
resp_len, token ids inside the tiny vocabulary). Simulated generation: every
sequence decodes at the same rate, so sample i finishes at
gen_time * len_i / max_len, and a group is done when its longest sample is.
`generate` returns after gen_time; `generate_stream` yields groups in finishing
order, at least `min_groups` per part, each part at its finishing time; the host
work done on a part does not delay the next one (the engine is modelled as
running on its own device). sync_weights runs the real shared-memory
transport's writer side (the ranks gather, rank 0 writes the region and its
probe reference: `backend.publish_weights`) and loads nothing.

The engine's `timeline` is the bench's clock for the step (time.monotonic, as
PhaseTimer spans and the rank probes): when generation started and ended, and
when the weight sync ended. At sync_weights it copies
`timings_source.last_timings` (the backend's public timings of the train
call, then of the publish) before the next call replaces them.

ProcEngine: the same engine inside the engine process of split placement (the
K = 1 mode: --rollout-world-size 1 --off-policy-steps 1), built there by
ranks.LongcotRankHooks.make_engine when ENGINE_SPEC_ENV names a spec
file. The controller writes that file (write_engine_spec: the engine's
arguments and the Run's PromptSet) once its Run is open; the engine reads it
at its first rollout and prepares the very responses and timeline the
controller's SyntheticEngine would (same seed, same prompts; the total is
checked). Weights are loaded into, and the sync's probe scored by, the real
engine cfg.engine names (`inner`), so the weight path is the real one; each
rollout's timeline goes as one JSON line to the spec's log.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from arenobench.lib import sleep_until
from arenobench.listref import ListRollouts

from areno.rollout.batch import RolloutBatch, offsets_from_lengths

REWARD_COST_ENV = "ARENO_BENCH_LONGCOT_REWARD_COST"
ENGINE_SPEC_ENV = "ARENO_BENCH_LONGCOT_ENGINE_SPEC"  # the K = 1 mode's spec file (ProcEngine)

REWARD_PLUGIN = '''\
"""bench_longcot reward: cost per sample from the file named by $%(env)s
("sleep <ms>" or "busy <ms>"), re-read when its mtime changes."""
import os
import time

_FILE = os.environ.get("%(env)s", "")
_state = {"mtime": None, "kind": "sleep", "s": 0.0}


def _cost():
    if not _FILE:
        return "sleep", 0.0
    m = os.stat(_FILE).st_mtime_ns
    if m != _state["mtime"]:
        with open(_FILE) as f:
            kind, ms = f.read().split()
        _state.update(mtime=m, kind=kind, s=float(ms) / 1000.0)
    return _state["kind"], _state["s"]


def reward_fn(record):
    kind, s = _cost()
    if s > 0:
        if kind == "busy":
            end = time.perf_counter() + s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(s)
    return (len(record.completion) %% 5) / 4.0
''' % {"env": REWARD_COST_ENV}


def set_reward_cost(path: Path, ms: float, busy: bool) -> None:
    """Every reward worker's cost per sample from its next call on (mtime bumped)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{'busy' if busy else 'sleep'} {ms}\n")
    os.replace(tmp, path)
    ns = time.time_ns()
    os.utime(path, ns=(ns, ns))


class _Block:
    """One prompt's n precomputed responses."""

    __slots__ = ("ids", "lengths", "logprobs", "finish", "finish_s")

    def __init__(self, ids: np.ndarray, lengths: np.ndarray, logprobs: np.ndarray, finish: np.ndarray,
                 finish_s: float) -> None:
        self.ids, self.lengths, self.logprobs, self.finish, self.finish_s = ids, lengths, logprobs, finish, finish_s


class SyntheticEngine:
    """A RolloutEngine returning precomputed responses after a simulated
    generation time (see the module docstring). Call prepare(prompts) once the
    Run's PromptSet exists; responses are keyed by the prompt's token ids.
    Colocated as the loop sees it (fleet.engines.EngineView): rounds run when
    collected, and sync_weights is the whole sync."""

    background = False
    dead = None

    def __init__(self, *, n: int, resp_len: int, max_new_tokens: int, vocab: tuple[int, int],
                 gen_time_s: float, seed: int = 0) -> None:
        self.n, self.resp_len, self.max_new = n, resp_len, max_new_tokens
        self.vocab, self.gen_time_s, self.seed = vocab, gen_time_s, seed
        self.max_model_len = 1 << 20
        self.blocks: dict[bytes, _Block] = {}
        self.timeline: dict = {}
        self.timings_source: Any = None  # has .last_timings (the backend); set once the Run is open

    # -- setup ------------------------------------------------------------
    def prepare(self, prompts: Any) -> int:
        """Precompute n responses per prompt of the PromptSet; lengths: a per-prompt
        base uniform in [0.25, 1.75] x resp_len times a per-sample factor in
        [0.75, 1.25], scaled so the total is P x n x resp_len, capped at
        max_new_tokens (finish 'length' there). Returns the total."""

        P, n = len(prompts), self.n
        rng = np.random.default_rng(self.seed)
        base = rng.uniform(0.25, 1.75, P)[:, None] * rng.uniform(0.75, 1.25, (P, n))
        want = P * n * self.resp_len
        lengths = np.clip(np.floor(base / base.sum() * want), 1, self.max_new).astype(np.int64)
        short = want - int(lengths.sum())
        room = np.flatnonzero(lengths.reshape(-1) < self.max_new)
        flat = lengths.reshape(-1)
        if short > 0 and room.size:
            add = np.zeros(flat.size, np.int64)
            add[room] = short // room.size
            add[room[: short % room.size]] += 1
            flat += add
            np.minimum(flat, self.max_new, out=flat)
        longest = int(lengths.max())
        lo, hi = self.vocab
        for p in range(P):
            key = prompts.ids[prompts.offsets[p]:prompts.offsets[p + 1]].tobytes()
            r = np.random.default_rng([self.seed, p])
            L = lengths[p]
            T = int(L.sum())
            self.blocks[key] = _Block(
                ids=r.integers(lo, hi, T, dtype=np.int64).astype(np.int32),
                lengths=L.copy(),
                logprobs=(-r.exponential(0.8, T)).astype(np.float32),
                finish=(L >= self.max_new).astype(np.uint8),
                finish_s=self.gen_time_s * float(L.max()) / longest,
            )
        return int(lengths.sum())

    def _keys(self, ids: np.ndarray, offsets: np.ndarray) -> list[bytes]:
        return [ids[offsets[p]:offsets[p + 1]].tobytes() for p in range(offsets.size - 1)]

    def _assemble(self, ids: np.ndarray, offsets: np.ndarray, keys: list[bytes], pos: np.ndarray) -> RolloutBatch:


        blocks = [self.blocks[keys[p]] for p in pos.tolist()]
        p_len = (offsets[1:] - offsets[:-1])[pos]
        return RolloutBatch(
            prompt_ids=np.concatenate([ids[offsets[p]:offsets[p + 1]] for p in pos.tolist()]),
            prompt_offsets=offsets_from_lengths(p_len),
            response_ids=np.concatenate([b.ids for b in blocks]),
            response_offsets=offsets_from_lengths(np.concatenate([b.lengths for b in blocks])),
            response_logprobs=np.concatenate([b.logprobs for b in blocks]),
            group_index=np.repeat(np.arange(len(blocks), dtype=np.int64), self.n),
            finish_reason=np.concatenate([b.finish for b in blocks]),
        )

    def _check(self, ids: Any, offsets: Any, n: int) -> tuple[np.ndarray, np.ndarray]:

        if n != self.n:
            raise ValueError(f"SyntheticEngine was prepared for n={self.n}, asked for {n}")
        return np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64)

    # -- RolloutEngine -----------------------------------------------------
    def generate(self, prompt_ids: Any, prompt_offsets: Any, n: int, sampling: Any) -> RolloutBatch:

        t0 = time.monotonic()
        ids, offsets = self._check(prompt_ids, prompt_offsets, n)
        keys = self._keys(ids, offsets)
        batch = self._assemble(ids, offsets, keys, np.arange(len(keys)))
        t_end = t0 + max(self.blocks[k].finish_s for k in keys)
        sleep_until(t_end)
        self.timeline = {"t_start": t0, "t_gen_end": t_end, "parts": 1, "late_s": time.monotonic() - t_end}
        return batch

    def generate_stream(self, prompt_ids: Any, prompt_offsets: Any, n: int, sampling: Any,
                        min_groups: int = 1) -> Iterator[tuple[np.ndarray, RolloutBatch]]:

        t0 = time.monotonic()
        ids, offsets = self._check(prompt_ids, prompt_offsets, n)
        keys = self._keys(ids, offsets)
        fin = np.array([self.blocks[k].finish_s for k in keys])
        order = np.argsort(fin, kind="stable")
        k = max(1, int(min_groups))
        parts = [order[i:i + k].astype(np.int64) for i in range(0, order.size, k)]
        built = [(pos, self._assemble(ids, offsets, keys, pos)) for pos in parts]
        self.timeline = {"t_start": t0, "t_gen_end": t0 + float(fin.max()), "parts": len(parts),
                         "part_groups": k}
        for pos, part in built:
            sleep_until(t0 + float(fin[pos].max()))
            yield pos, part
        self.timeline["t_exhausted"] = time.monotonic()

    def generate_lists(self, prompt_ids: Any, prompt_offsets: Any, n: int) -> tuple[ListRollouts, list[int]]:
        """The reference's native rollout form (what a list-based engine returns):
        per-sample Python lists, after the same simulated generation time."""

        t0 = time.monotonic()
        ids, offsets = self._check(prompt_ids, prompt_offsets, n)
        keys = self._keys(ids, offsets)
        prompts, responses, logprobs, group_of = [], [], [], []
        for g, key in enumerate(keys):
            b = self.blocks[key]
            prompts.append(ids[offsets[g]:offsets[g + 1]].tolist())
            o = 0
            for L in b.lengths.tolist():
                responses.append(b.ids[o:o + L].tolist())
                logprobs.append(b.logprobs[o:o + L].tolist())
                group_of.append(g)
                o += L
        finish = [int(x) for k in keys for x in self.blocks[k].finish.tolist()]
        t_end = t0 + max(self.blocks[k].finish_s for k in keys)
        sleep_until(t_end)
        self.timeline = {"t_start": t0, "t_gen_end": t_end, "parts": 1, "late_s": time.monotonic() - t_end}
        return ListRollouts(prompts, responses, logprobs, group_of, rewards=[]), finish

    def sync_weights(self) -> dict:
        """The backend publishes its weights (the real writer side); nothing is loaded."""
        src = self.timings_source
        train = self._source_timings()
        src.publish_weights()
        self.timeline.update(t_update_weights=time.monotonic(), train=train, export=self._source_timings())
        return self.timeline["export"]

    def publish(self, slot: int = 0) -> tuple[None, dict]:
        return None, self.sync_weights()

    def load(self, region: Any) -> dict:
        raise RuntimeError("a colocated stand-in loads through sync_weights")

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:

        return np.zeros(max(0, len(ids) - 1), dtype=np.float32)

    def _source_timings(self) -> dict:
        return dict(getattr(self.timings_source, "last_timings", {}))

    def shutdown(self) -> None:
        pass


class _PromptArrays:
    """The PromptSet fields prepare() reads."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        self.ids, self.offsets = ids, offsets

    def __len__(self) -> int:
        return self.offsets.size - 1


def write_engine_spec(path: Path, engine: SyntheticEngine, prompts: Any, total: int, log: Path) -> None:
    """What ProcEngine needs to prepare `engine`'s responses in another process."""
    np.savez(path.with_suffix(".npz"), ids=np.asarray(prompts.ids), offsets=np.asarray(prompts.offsets))
    spec = {"n": engine.n, "resp_len": engine.resp_len, "max_new_tokens": engine.max_new,
            "vocab": list(engine.vocab), "gen_time_s": engine.gen_time_s, "seed": engine.seed,
            "prompts": str(path.with_suffix(".npz")), "total": total, "log": str(log)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, path)


class ProcEngine(SyntheticEngine):
    """SyntheticEngine in an engine process (see the module docstring): prepared
    from the spec file at the first rollout; weights, their check and the probe
    go to `inner`, the real engine."""

    def __init__(self, inner: Any, spec_path: Path) -> None:
        super().__init__(n=0, resp_len=0, max_new_tokens=0, vocab=(0, 0), gen_time_s=0.0)
        self.inner, self.spec_path, self.log = inner, Path(spec_path), None

    def _ready(self) -> None:
        if self.log is not None:
            return
        spec = json.loads(self.spec_path.read_text())
        self.n, self.resp_len, self.max_new = spec["n"], spec["resp_len"], spec["max_new_tokens"]
        self.vocab, self.gen_time_s, self.seed = tuple(spec["vocab"]), spec["gen_time_s"], spec["seed"]
        with np.load(spec["prompts"]) as z:
            total = self.prepare(_PromptArrays(z["ids"], z["offsets"]))
        if total != spec["total"]:
            raise RuntimeError(f"ProcEngine prepared {total} response tokens, the controller {spec['total']}")
        self.log = Path(spec["log"])

    def generate_stream(self, prompt_ids: Any, prompt_offsets: Any, n: int, sampling: Any,
                        min_groups: int = 1) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        self._ready()
        yield from super().generate_stream(prompt_ids, prompt_offsets, n, sampling, min_groups)
        with open(self.log, "a") as f:
            f.write(json.dumps({k: v for k, v in self.timeline.items() if isinstance(v, (int, float))}) + "\n")

    def generate(self, *a: Any, **k: Any) -> RolloutBatch:
        self._ready()
        return super().generate(*a, **k)

    def sync_weights(self) -> dict:
        raise RuntimeError("an engine process loads weights through load_weights")

    def load_weights(self, named_tensors: Any) -> None:
        self.inner.load_weights(named_tensors)

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        return self.inner.prompt_logprobs(ids)

    def __getattr__(self, name: str) -> Any:  # weights_fingerprint, _weight_names, ... when inner has them
        # generate_rounds: the real engine's tail-fill loop would sample with its
        # own weights, not this engine's precomputed responses; each round runs
        # as its own command.
        if name in ("inner", "generate_rounds"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def shutdown(self) -> None:
        self.inner.shutdown()


def write_dataset(path: Path, num_prompts: int, words: int, seed: int) -> None:
    """num_prompts JSONL rows of `words` random words each (answer: i % 10)."""

    rng = random.Random(seed)
    vocab = ("the model thinks step by step about numbers and adds them then checks the answer "
             "question apples train speed miles hours total each more less how many").split()
    with open(path, "w") as f:
        for i in range(num_prompts):
            text = f"Problem {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) + "?"
            f.write(json.dumps({"prompt": text, "answer": str(i % 10)}) + "\n")

