"""An engine process's in-flight weight loads under --partial-rollouts.

While a round generates, the controller *offers* each version the ranks publish
(EngineProcs.offer: a message with no reply, which the command reader thread
hands to `offer` at once, not behind the queued rounds). The engine's step hook
(`step`, run between two decode steps: rollout/hf_inflight.py,
rollout/vllm_inflight.py) loads the newest offer in place with
`update_weights_inflight`, the requests it holds kept, and checks the exact
fingerprint of what it loaded, every time (a torn or stale region must never
sample). The probe (a forward of the fixed sequence) costs more than a decode
step: it is deferred to the round's end (`finish`), run on the newest region
loaded when that one carries a probe reference.

Why an offer is never read after its slot is rewritten: version v's region is
rewritten by v + K + 1, published only once the round carrying v was collected
(scheduler.py); that round starts here after the offer of v came (one pipe, in
order), and `begin` drops every offer not newer than the version a round starts
with.

Under --cut-at-deadline an offer also carries the deadline it sets: the
trainer holding version u, a round admitted with u - K or older is due, and
`step` hands that to the engine (engine.cut_version): its loop ends the due
rounds' samples still generating, finish "length" (rollout/vllm_rounds.py,
rollout/hf_rounds.py), and counts them (engine.cut_samples).

Per round: begin(version) -> step(...) at each step boundary -> finish() -> the
reply's figures {inflight_loads, inflight_checks, inflight_load_s, cut_samples, + probe}.
Under tail fill (fleet/tail_fill.py) a queued round joins the generation
(adopt: its region loaded here, when newer), and a round that ends while a
later one still runs takes `figures()`; the last one's finish() probes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from areno.fleet.weight_sync import SyncCheck, WeightRegion, load_region, region_held
from areno.rollout.engine import due


class InflightLoads:
    """The in-flight loads of one engine process (`engine`, checked by `check`)."""

    def __init__(self, engine: Any, check: SyncCheck) -> None:
        self.engine, self.check = engine, check
        self.version: int | None = None  # the weights the engine holds (None: not told yet)
        self._offer: tuple[int, WeightRegion] | None = None
        self._cut: int | None = None  # --cut-at-deadline: rounds of this version or older are due
        self._lock = threading.Lock()  # the reader thread offers while the hook takes
        self._halt = False  # the run is saving (halt), never cleared: it exits after the save
        self._haltable = False  # the round generating may be halted (all but an agent's)
        self._reset()

    def _reset(self) -> None:
        self.loads, self.checks, self.load_s = 0, 0, 0.0
        self._probe: WeightRegion | None = None  # the newest region loaded in this round

    def offer(self, region: WeightRegion, version: int, cut: int | None = None) -> None:
        """The command reader thread: weights of `version` were published (kept if
        newest); cut (--cut-at-deadline): the newest version whose rounds are due."""
        with self._lock:
            if self._offer is None or version > self._offer[0]:
                self._offer = (int(version), region)
            if cut is not None and (self._cut is None or cut > self._cut):
                self._cut = int(cut)

    def halt(self) -> None:
        """The command reader thread: the run is saving (Ctrl-C). Every haltable round,
        running or queued, ends at its next step boundary with the tokens it
        sampled (finish "abort"); the resumed run continues them (areno/continuation.py,
        envs/resume.py)."""
        self._halt = True

    def due(self, version: int | None) -> bool:
        """--cut-at-deadline: whether a round admitted with `version` is due now
        (rollout.engine.due); the multi-turn loop asks between turns (envs/rounds.py)."""
        with self._lock:
            return due(version, self._cut)

    def halting(self) -> bool:
        """Whether the run is saving and the round generating may be halted: at a
        step boundary (`step`), and while a multi-turn round's trajectories wait
        on their environments (envs/rounds.py polls it; envs/halted.py)."""
        return self._halt and self._haltable

    def newer(self, version: int) -> bool:
        """Whether weights of `version` are newer than those the engine holds."""
        return self.version is None or version > self.version

    def begin(self, version: int, haltable: bool = False) -> None:
        """A round starts, the engine holding `version` at least (loaded just now, or
        newer ones loaded in flight before): tag its tokens, drop stale offers.
        haltable: a halt ends it (single-turn, or an environment's round, whose
        trajectories go back with their states: envs/halted.py; an agent's
        conversations live in its program, so it runs to its end)."""
        self._haltable = haltable
        self.version = version if self.newer(version) else self.version
        self.engine.weight_version = self.version
        with self._lock:
            if self._offer is not None and self._offer[0] <= self.version:
                self._offer = None
        self._reset()
        self.engine.step_hook = self.step

    def step(self, steps: int) -> None:
        """Step boundary (the engine's step_hook): load the newest offer, if newer;
        once the run is saving, end a haltable round here instead (engine.halt)."""
        if self.halting():
            self.engine.halt = True
            return
        with self._lock:
            offer, self._offer = self._offer, None
            self.engine.cut_version = self._cut
        if offer is not None and self.newer(offer[0]):
            self.load(offer[1], offer[0])

    def adopt(self, region: WeightRegion | None, version: int) -> None:
        """A queued round joins the running generation (tail fill, fleet/tail_fill.py):
        its weights `region` of `version` are loaded now, between decode steps, when
        newer than those held, so none of its tokens samples older weights."""
        if region is not None and self.newer(version):
            self.load(region, version)
        self.version = version if self.newer(version) else self.version
        with self._lock:
            if self._offer is not None and self._offer[0] <= self.version:
                self._offer = None

    def load(self, region: WeightRegion, version: int) -> None:
        """Load `region` in flight, checked by its fingerprint (the probe: `finish`)."""
        t0 = time.perf_counter()
        # Fingerprint now (probe=False): the probe is the round end's (finish).
        load_region(self.engine, region, self.check, version=version, probe=False)
        self.version = version
        self.loads += 1
        self.checks += int(self.check.fingerprinted)
        self.load_s += time.perf_counter() - t0
        self._probe = region

    def figures(self) -> dict:
        """The loads since the last figures (a round's, when a later round keeps the
        generation going: no probe while the engine holds requests)."""
        out: dict = {"inflight_loads": self.loads, "inflight_checks": self.checks,
                     "inflight_load_s": self.load_s, "cut_samples": self.engine.cut_samples}
        self.loads, self.checks, self.load_s, self.engine.cut_samples = 0, 0, 0.0, 0
        return out

    def finish(self) -> dict:
        """The round ended -> its figures for the reply (the deferred probe's with them)."""
        self.engine.step_hook = None
        self.engine.halt = False
        out = self.figures()
        region = self._probe
        if region is not None and region.probe is not None:
            out |= self.check.check(self.engine, region.fingerprint, region.probe,
                                    held=region_held(self.engine, region, self.check))
        return out
