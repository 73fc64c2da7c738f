"""Partial rollouts against whole rounds, simulated on one long-tail workload:
synchronous (K = 0), K-ahead (areno without --partial-rollouts: a round is one
engine command, its weights loaded at its start, the next round queued behind
its slowest sample), partial rollouts at the same K (arenobench.partial_pool.PartialPool:
groups submitted as slots free, new weights taken between decode steps, a
batch = the first groups to finish, retirement by the lag bound) and
first-finished (what areno runs under --partial-rollouts: whole rounds admitted
at depth K, the next round's groups taking slots as they free, as tail fill
does, weights between decode steps, a batch by partial.deadline_first with a
group's deadline its round's admission version + K).

The engines are `slots` decode slots; a sample in a slot makes one token a tick
(decoding is memory bound: a step costs the same at any occupancy, so an empty
slot is throughput lost). Completion lengths are lognormal (median, sigma),
capped at max_tokens; with turns > 1 a sample leaves its slot between turns for
an environment delay, lognormal too (median env_s, sigma env_sigma). Training
a step takes train_s ticks, and loading new weights stalls every slot for
sync_s ticks. Every mode draws the same samples in the same order (a prompt's
lengths and delays are fixed by its index), so the modes differ only in
scheduling. Reported per mode: trained tokens per tick, engine idle fraction
(slot-ticks without a token: waiting for work, for weights, in the tail), the
tokens generated but never trained (retired by the lag bound, or past the last
step), and the per-token lag histogram of what was trained.

The `steps` trained are a window of a longer run: every mode keeps admitting
work past it, as it would with steps still to come, so no mode's figures count
the end of a run (its last rounds draining with nothing behind them: at depth
K, about K steps of engine time, K / N of an N-step run, in every mode that
admits ahead; a window of 60 steps at K = 4 would read 6.2% idle where the
steady state reads 1.9%).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from areno.partial import deadline_first
from arenobench.partial_pool import PartialPool


@dataclass(frozen=True)
class Workload:
    batch_size: int = 16       # groups a step trains
    n: int = 4                 # samples a group
    median: float = 40.0       # completion tokens, median
    sigma: float = 1.5         # lognormal sigma of the completion lengths
    max_tokens: int = 1024     # cap (finish_reason length)
    turns: int = 1             # > 1: multi-turn, an environment delay between turns
    env_s: float = 20.0        # median environment delay, ticks
    env_sigma: float = 1.5
    slots: int = 64            # decode slots of the engines
    train_s: float = 100.0     # ticks a step trains
    sync_s: float = 10.0       # ticks a weight load stalls the engines
    steps: int = 30
    seed: int = 0


class Samples:
    """The prompts' samples, drawn once: attempt a at prompt p's n lengths and
    delays (an attempt after a retirement samples afresh)."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.length: dict[tuple[int, int], np.ndarray] = {}
        self.delay: dict[tuple[int, int], np.ndarray] = {}

    def of(self, prompt: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """([n] int64 tokens, [n, turns - 1] float64 delays) of (prompt, attempt)'s samples."""
        if prompt not in self.length:
            rng = np.random.default_rng([self.w.seed, *prompt])
            w = self.w
            self.length[prompt] = np.clip(np.rint(rng.lognormal(np.log(w.median), w.sigma, w.n)),
                                          1, w.max_tokens).astype(np.int64)
            self.delay[prompt] = rng.lognormal(np.log(w.env_s), w.env_sigma, (w.n, max(w.turns - 1, 0)))
        return self.length[prompt], self.delay[prompt]


class Engines:
    """Decode slots over samples (sample = (group id, j)); per sample its tokens
    left per turn, the version of each token it made, where it is."""

    def __init__(self, w: Workload, samples: Samples) -> None:
        self.w, self.samples = w, samples
        self.queue: list[tuple[int, int]] = []          # ready, waiting for a slot
        self.running: list[tuple[int, int]] = []        # in a slot
        self.env: dict[tuple[int, int], float] = {}     # at its environment until tick
        self.left: dict[tuple[int, int], list[int]] = {}
        self.versions: dict[tuple[int, int], list[int]] = {}
        self.prompt: dict[int, tuple[int, int]] = {}  # group id -> (prompt, attempt)
        self.turn_delays: dict[tuple[int, int], list[float]] = {}
        self.busy_ticks = self.slot_ticks = 0.0

    def add_group(self, gid: int, prompt: tuple[int, int]) -> None:
        lengths, delays = self.samples.of(prompt)
        self.prompt[gid] = prompt
        for j in range(self.w.n):
            turns = np.array_split(np.arange(lengths[j]), self.w.turns)
            self.left[(gid, j)] = [t.size for t in turns if t.size]  # a short sample: fewer turns
            self.turn_delays[(gid, j)] = delays[j].tolist()
            self.versions[(gid, j)] = []
            self.queue.append((gid, j))

    def cut_group(self, gid: int) -> int:
        """End a group's unfinished samples where they are (tokens kept) -> how many."""
        ends = [(gid, j) for j in range(self.w.n) if self.left[(gid, j)]]
        for s in ends:
            self.left[s] = []
            self.env.pop(s, None)
        self.queue = [s for s in self.queue if s[0] != gid]
        self.running = [s for s in self.running if s[0] != gid]
        return len(ends)

    def drop_group(self, gid: int) -> int:
        """Remove a group's samples wherever they are -> the tokens they had made."""
        keys = [(gid, j) for j in range(self.w.n)]
        self.queue = [s for s in self.queue if s[0] != gid]
        self.running = [s for s in self.running if s[0] != gid]
        made = 0
        for s in keys:
            self.env.pop(s, None)
            self.left.pop(s)
            self.turn_delays.pop(s)
            made += len(self.versions.pop(s))
        del self.prompt[gid]
        return made

    def tick(self, t: float, version: int, stalled: bool) -> list[tuple[int, int]]:
        """One decode step at tick t -> the samples that finished in it."""
        for s, ready in list(self.env.items()):
            if ready <= t:
                del self.env[s]
                self.queue.append(s)
        while len(self.running) < self.w.slots and self.queue:
            self.running.append(self.queue.pop(0))
        self.slot_ticks += self.w.slots
        if stalled:
            return []
        self.busy_ticks += len(self.running)
        done, keep = [], []
        for s in self.running:
            left = self.left[s]
            self.versions[s].append(version)
            left[0] -= 1
            while left and left[0] <= 0:  # an empty turn ends at once too
                left.pop(0)
                if left:
                    self.env[s] = t + self.turn_delays[s].pop(0)
            if not left:
                done.append(s)
            elif s not in self.env:
                keep.append(s)
        self.running = keep
        return done

    def group_versions(self, gid: int) -> np.ndarray:
        return np.concatenate([np.asarray(self.versions[(gid, j)], np.int64) for j in range(self.w.n)])


@dataclass
class Result:
    mode: str
    k: int
    ticks: float
    trained_tokens: int
    generated_tokens: int
    idle: float
    lags: np.ndarray      # [trained tokens] per-token lag
    retired_tokens: int = 0  # generated by groups the lag bound retired
    cut: float = 0.0  # share of the trained samples cut at their group's deadline

    @property
    def tokens_per_tick(self) -> float:
        return self.trained_tokens / self.ticks

    @property
    def retired(self) -> float:
        """Share of the generated tokens retired by the lag bound (the rest not
        trained were in flight when the last step ended)."""
        return self.retired_tokens / max(self.generated_tokens, 1)


class Trainer:
    """Steps of train_s ticks; u updates done; records what each step trained."""

    def __init__(self, w: Workload) -> None:
        self.w, self.u, self.until, self.tokens, self.lags = w, 0, -1.0, 0, []

    @property
    def done(self) -> bool:
        return self.u >= self.w.steps and self.until < 0

    def train(self, t: float, versions: list[np.ndarray]) -> None:
        v = np.concatenate(versions)
        self.tokens += v.size
        self.lags.append(self.u - v)
        self.until = t + self.w.train_s

    def finished(self, t: float) -> bool:
        """The step in progress ends at tick t (an update is published)."""
        if self.until >= 0 and t >= self.until:
            self.u, self.until = self.u + 1, -1.0
            return True
        return False


def run_rounds(w: Workload, k: int) -> Result:
    """Whole rounds: round r (B groups, prompts r*B..) starts when the round
    before it is done and r - published <= k; it samples with the weights
    published at its start (a load of sync_s); step r trains round r."""
    eng, tr = Engines(w, Samples(w)), Trainer(w)
    published, cur, r_next, t, stall_until = 0, None, 0, 0.0, -1.0
    done_rounds: dict[int, list[int]] = {}
    left: set[int] = set()
    version = 0
    while not tr.done:
        if cur is None and r_next - published <= k:
            cur, left = r_next, set(range(r_next * w.batch_size, (r_next + 1) * w.batch_size))
            if published != version:
                version, stall_until = published, t + w.sync_s
            for gid in sorted(left):
                eng.add_group(gid, (gid, 0))
            r_next += 1
        for gid, _ in eng.tick(t, version, t < stall_until):
            if all(not eng.left.get((gid, j), [1]) for j in range(w.n)) and gid in left:
                left.discard(gid)
        if cur is not None and not left:
            done_rounds[cur], cur = list(range(cur * w.batch_size, (cur + 1) * w.batch_size)), None
        if tr.finished(t):
            published = tr.u
        if tr.until < 0 and tr.u in done_rounds:
            gids = done_rounds.pop(tr.u)
            tr.train(t, [eng.group_versions(g) for g in gids])
            for g in gids:
                eng.drop_group(g)
        t += 1
    generated = tr.tokens + sum(len(v) for v in eng.versions.values())
    return Result("sync" if k == 0 else "K-ahead", k, t, tr.tokens, generated,
                  1 - eng.busy_ticks / eng.slot_ticks, np.concatenate(tr.lags))


def run_partial(w: Workload, k: int) -> Result:
    """Partial rollouts: groups submitted as slots free (within PartialPool's
    room), weights taken between decode steps as soon as published, a step
    trains the first B groups to finish; groups retired by the lag bound are
    submitted again (their prompt, new group id)."""
    eng, tr, pool = Engines(w, Samples(w)), Trainer(w), PartialPool(w.batch_size, k)
    t, stall_until, next_gid, next_prompt, retired_tokens = 0.0, -1.0, 0, 0, 0
    resubmit: list[tuple[int, int]] = []
    while not tr.done:
        while len(eng.running) + len(eng.queue) < w.slots and pool.room() > 0:
            if resubmit:
                p, attempt = resubmit.pop(0)
                prompt = (p, attempt + 1)
            else:
                prompt, next_prompt = (next_prompt, 0), next_prompt + 1
            pool.submit(next_gid)
            eng.add_group(next_gid, prompt)
            next_gid += 1
        for gid, _ in eng.tick(t, pool.version, t < stall_until):
            if all(not eng.left.get((gid, j), [1]) for j in range(w.n)):
                pool.finish(gid, t)
        if tr.finished(t):  # published: the engines take it between two steps
            stall_until = t + w.sync_s
            for gid in pool.update(tr.u):
                resubmit.append(eng.prompt[gid])
                retired_tokens += eng.drop_group(gid)
        if tr.until < 0 and tr.u < w.steps and (gids := pool.take(tr.u)) is not None:
            tr.train(t, [eng.group_versions(g) for g in gids])
            for g in gids:
                eng.drop_group(g)
        t += 1
    generated = tr.tokens + retired_tokens + sum(len(v) for v in eng.versions.values())
    return Result("partial", k, t, tr.tokens, generated, 1 - eng.busy_ticks / eng.slot_ticks,
                  np.concatenate(tr.lags), retired_tokens)


def run_first_finished(w: Workload, k: int, whole: bool = False, cut: bool = False) -> Result:
    """areno's --partial-rollouts (areno/first_finished.py): round r (B groups) is
    admitted once r - u <= k (u: updates published, the version it samples
    with), its groups queued behind what runs; weights taken between decode
    steps as soon as published; a step trains deadline_first's groups (whole:
    the oldest round's, once all are done, as before first_finished.py). cut
    (--cut-at-deadline): the groups due now (round version u - k) end where
    they are, their samples' tokens kept (Result.cut counts the samples)."""
    eng, tr = Engines(w, Samples(w)), Trainer(w)
    t, stall_until, r_next, cut_samples = 0.0, -1.0, 0, 0
    start: dict[int, int] = {}
    done_at: dict[int, float] = {}
    while not tr.done:
        while r_next - tr.u <= k:
            for gid in range(r_next * w.batch_size, (r_next + 1) * w.batch_size):
                eng.add_group(gid, (gid, 0))
                start[gid], done_at[gid] = tr.u, np.inf
            r_next += 1
        for gid, _ in eng.tick(t, tr.u, t < stall_until):
            if all(not eng.left.get((gid, j), [1]) for j in range(w.n)):
                done_at[gid] = t
        if tr.finished(t):
            stall_until = t + w.sync_s
        if tr.until < 0 and tr.u < w.steps:
            ids = np.fromiter(start, np.int64, len(start))
            at = np.array([done_at[g] for g in ids.tolist()])
            for i in (np.flatnonzero(~np.isfinite(at) & (np.array([start[g] for g in ids.tolist()]) <= tr.u - k))
                      if cut else []):
                cut_samples += eng.cut_group(int(ids[i]))
                at[i] = done_at[int(ids[i])] = t
            if whole:  # ids are in admission order: the oldest round is the first B
                pick = np.arange(w.batch_size) if np.isfinite(at[:w.batch_size]).all() else None
            else:
                pick = deadline_first(np.array([start[g] for g in ids.tolist()]), at, tr.u, k, w.batch_size)
            if pick is not None:
                gids = ids[pick].tolist()
                tr.train(t, [eng.group_versions(g) for g in gids])
                for g in gids:
                    eng.drop_group(g)
                    del start[g], done_at[g]
        t += 1
    generated = tr.tokens + sum(len(v) for v in eng.versions.values())
    mode = "tail fill, whole rounds" if whole else "first-finished" + (", cut at deadline" if cut else "")
    return Result(mode, k, t, tr.tokens, generated, 1 - eng.busy_ticks / eng.slot_ticks, np.concatenate(tr.lags),
                  cut=cut_samples / (w.steps * w.batch_size * w.n))


def compare(w: Workload, k: int) -> list[Result]:
    """The modes on one workload: sync (K = 0), K-ahead, partial at K, then areno's
    --partial-rollouts at K before first_finished.py (whole rounds) and with it."""
    return [run_rounds(w, 0), run_rounds(w, k), run_partial(w, k), run_first_finished(w, k, whole=True),
            run_first_finished(w, k), run_first_finished(w, k, cut=True)]


def table(results: list[Result], title: str) -> str:
    base = results[0].tokens_per_tick
    out = [f"{title}", "| mode | K | trained tokens/tick | x sync | x K-ahead | engine idle | tokens retired "
           "| samples cut | token lag mean | max | histogram |", "| --- " * 11 + "|"]
    ahead = results[1].tokens_per_tick
    for r in results:
        hist = np.bincount(r.lags, minlength=r.k + 1).tolist() if r.lags.size else []
        out.append(f"| {r.mode} | {r.k} | {r.tokens_per_tick:.2f} | {r.tokens_per_tick / base:.2f} | "
                   f"{r.tokens_per_tick / ahead:.2f} | {100 * r.idle:.1f}% | {100 * r.retired:.1f}% | "
                   f"{100 * r.cut:.1f}% | "
                   f"{r.lags.mean():.2f} | {r.lags.max()} | {hist} |")
    return "\n".join(out)


# The long-tail workloads of `bench_async.py --partial`: completion lengths
# lognormal with sigma >= 1.5, and the same with an environment of heavy-tailed
# delays between three turns.
TARGETS = {"x sync": 2.0, "x K-ahead": 1.5, "idle": 0.05}


def workloads(sigma: float, steps: int) -> dict[str, Workload]:
    base = Workload(batch_size=32, n=8, sigma=sigma, train_s=400.0, steps=steps)
    return {f"long tail (sigma {sigma:g})": base,
            f"env, 3 turns, delays sigma {base.env_sigma:g}": Workload(**{**base.__dict__, "turns": 3})}


def misses(results: list[Result]) -> list[str]:
    """The TARGETS each partial mode missed on one workload: the pool's and
    first-finished's (what areno runs, with and without --cut-at-deadline), each named."""
    sync, ahead = results[0].tokens_per_tick, results[1].tokens_per_tick
    out = []
    for r in [r for r in results[2:] if r.mode != "tail fill, whole rounds"]:
        part = r.tokens_per_tick
        if part < TARGETS["x sync"] * sync:
            out.append(f"{r.mode} {part / sync:.2f}x sync < {TARGETS['x sync']}")
        if part < TARGETS["x K-ahead"] * ahead:
            out.append(f"{r.mode} {part / ahead:.2f}x K-ahead < {TARGETS['x K-ahead']}")
        if r.idle > TARGETS["idle"]:
            out.append(f"{r.mode} idle {100 * r.idle:.1f}% > {100 * TARGETS['idle']:.0f}%")
    return out


def max_delay(w: Workload, rounds: int) -> float:
    """The median of the longest of `rounds` rounds' environment delays
    (rounds * batch_size * n * (turns - 1) lognormal draws), in ticks."""
    m = rounds * w.batch_size * w.n * (w.turns - 1)
    return w.env_s * float(np.exp(w.env_sigma * NormalDist().inv_cdf(0.5 ** (1 / m))))


def partial_report(k: int, sigma: float, steps: int) -> tuple[str, dict]:
    """Every workload's side-by-side table -> (the text, the rows as JSON)."""
    text, rows = [], {}
    for name, w in workloads(sigma, steps).items():
        res = compare(w, k)
        missed = misses(res)
        text += [table(res, f"{name}: {w}"), "targets: " + ("met" if not missed else "MISSED: " + "; ".join(missed))]
        if w.max_tokens > k * w.train_s:
            text.append(f"bound: a capped sample decodes {w.max_tokens} ticks, longer than K = {k} steps of "
                        f"training ({k * w.train_s:g}): the trainer waits for it, or it is retired or cut")
        if w.turns > 1:
            text.append(f"bound: the slowest environment wait is about {max_delay(w, 1):.0f} ticks in a round, "
                        f"{max_delay(w, steps):.0f} in {steps}; K = {k} steps of training are {k * w.train_s:g}")
        text.append("")
        rows[name] = [{"mode": r.mode, "k": r.k, "trained_tokens_per_tick": r.tokens_per_tick,
                       "idle": r.idle, "retired": r.retired, "cut": r.cut, "lag_mean": float(r.lags.mean()),
                       "lag_hist": np.bincount(r.lags, minlength=r.k + 1).tolist()} for r in res]
    return "\n".join(text), rows
