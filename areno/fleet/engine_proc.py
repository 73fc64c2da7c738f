"""Split placement: one engine process, beside the ranks (fleet/engine_procs.py
starts M of them and holds their pipes).

It trains nothing and joins no process group: `spawn_main` does a peer's start-up
(signals, parent watch, heartbeat, the heavy imports while the controller loads
its data), takes its EngineProcsConfig from its pipe and serves an `EngineWorker`
(procs/serve.py). On CPU the processes share the cores; on GPU engine i takes
GPU N + i of the controller's (EngineProcsConfig.engine_gpus to place it
elsewhere), the only one it sees (engine_procs.engine_env sets its
CUDA_VISIBLE_DEVICES: vLLM takes device 0 whatever torch.cuda.set_device says).
Its start-up is one code path on CPU and GPU up to the device call
(procs.device.claim_device); the vLLM engine is in-process on every device
(rollout.factory), so load_weights can take the region's tensors, and takes
0.9 of its GPU unless --gpu-memory-utilization says otherwise
(settings.engine_gpu_memory).

Prompts reach it as they reach a rank's engine (`generate`, the same
OutRegion/part protocol: engine_host.generate_into). Weights reach it through
the shared-memory transport (weight_sync.py): after each train step rank 0
writes the region and the controller sends `load_region`; the engine loads it
and runs the same check (exact fingerprint, the probe when due) as a rank's
own engine. Under LoRA the engine is built on the base model serving adapters
(`EngineSpec.max_lora_rank`, as the ranks' engines), and the region holds the
adapter alone, which load_region hands to `load_adapter` as a colocated sync
does (fleet.adapter_sync).
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from areno.fleet.engine_host import OutRegion, generate_into
from areno.fleet.episode_rounds import SeedShare, episode_part, run_episode_rounds
from areno.fleet.hooks import EngineHooks, load_hooks
from areno.fleet.inflight_loads import InflightLoads
from areno.fleet.tail_fill import run_rounds
from areno.procs.device import claim_device
from areno.procs.heartbeat import start_beating
from areno.procs.lifecycle import allow_children, die_with_parent, set_title, start_up
from areno.procs.serve import CommandInbox, quiet_peer, serve_worker
from areno.rundir.log import move_child_output, redirect_child_output
from areno.timing import startup_mark
from areno.fleet.weight_sync import SyncCheck, WeightRegion, load_region, reports_fingerprint
from areno.rollout.factory import make_engine
from areno.rollout.engine import RoundRequest

if TYPE_CHECKING:
    from areno.fleet.engine_procs import EngineProcsConfig

INDEX_ENV = "ARENO_ENGINE_INDEX"  # i of the M engine processes (engine_procs.engine_env)


def spawn_main(conn: Connection, env: dict[str, str], parent_pid: int, use_pdeathsig: bool,
               beats: Any = None) -> None:
    """Target of engine_procs.spawn_engine_procs: the heavy imports first, then the
    EngineProcsConfig from the pipe (the controller may still be loading its
    tokenizer and data meanwhile); beats: heartbeat slots."""
    os.environ.update(env)  # first: its CUDA_VISIBLE_DEVICES (engine_procs.engine_env)
    quiet_peer()  # before any thread starts: they inherit the signal mask
    die_with_parent(parent_pid, use_pdeathsig)
    i = int(env[INDEX_ENV])
    set_title(f"areno: engine {i} of run {parent_pid}", f"areno-engine{i}")
    if beats is not None:
        start_beating(beats, i)
    redirect_child_output()  # third-party output to RUN_DIR/run.log (see areno/rundir/log.py)
    startup_mark("peer imports")
    with start_up():
        import transformers  # the heavy imports (torch came with this module), while the controller works

        transformers.AutoModelForCausalLM  # noqa: B018 - the lazy module's heavy import, now
    startup_mark("peer imported")
    try:
        cfg = conn.recv()
    except (EOFError, OSError):  # the controller stopped first (a user mistake in its data)
        os._exit(4)
    move_child_output(cfg.run_log)  # started before the run dir existed (runtime/early.py)
    allow_children()  # its episodes' environment or agent workers (EngineWorker.cmd_episodes)
    serve_worker(lambda: EngineWorker(cfg), conn, i, queued=True)


class EngineWorker:
    """One engine process: engine `INDEX_ENV` (i) of the M."""

    def __init__(self, cfg: EngineProcsConfig, *, same_host: bool = True) -> None:
        self.cfg = cfg
        self.index = int(os.environ[INDEX_ENV])
        self.same_host = same_host
        # GPU: device 0, the one GPU it sees (engine_procs.engine_env: GPU N + i of
        # the controller's). TP inside one is refused (config/offpolicy.py).
        self.device = claim_device(cfg.device, cfg.cpu_threads, 0, cfg.count)
        self.hooks = load_hooks(EngineHooks)  # no-ops unless ARENO_RANK_HOOKS names some (benchmarks)
        made = self.hooks.make_engine(cfg, self.device)  # None but in benchmarks (hooks.py)
        self.engine, self.engine_kind = made if made is not None else \
            make_engine(cfg.engine, cfg.model_path, self.device)
        self.sync_check = SyncCheck(reports_fingerprint(self.engine), self.index)
        # --partial-rollouts: weights offered mid-round, loaded between decode steps.
        # "offer" runs on the command reader thread (procs.serve.queued_commands), not
        # behind the rounds queued here, and has no reply.
        self.inflight = InflightLoads(self.engine, self.sync_check)
        self.immediate = {"offer": self.inflight.offer, "halt": self.inflight.halt}  # offer: its cut too
        self.emit = None  # set by serve(): sends one ("part", ...) message mid-command
        # Set by serve_worker (queued commands): the queued commands, and a reply sent
        # before the command ends (tail fill: a rollout replies for those it took).
        self.inbox: CommandInbox | None = None
        self.reply = None
        self._idle_since: float | None = None  # the end of the last rollout (cmd_rollout)
        self._episodes = None  # EpisodeHost or AgentEpisodes, at the first `episodes` command

    def hello(self) -> dict:
        return {"rank": self.index, "pid": os.getpid(), "host": os.uname().nodename, "same_host": self.same_host,
                "engine": self.engine_kind, "engine_max_model_len": getattr(self.engine, "max_model_len", None),
                "engine_note": getattr(self.engine, "note", None),
                "fingerprinted": self.sync_check.fingerprinted, "cpu_threads": torch.get_num_threads()}

    def close(self) -> None:
        if self._episodes is not None:
            self._episodes.close()
        self.engine.shutdown()

    def cmd_generate(self, ids: np.ndarray, offsets: np.ndarray, n: int, sampling,
                     out: OutRegion, leader: bool) -> dict:
        """Sample these prompts, streaming finished parts back (engine_host.generate_into)."""
        t0 = time.perf_counter()
        self.hooks.rollout_begin(self.index)
        tokens = generate_into(self.engine, ids, offsets, n, sampling, out, self.emit) if offsets.size > 1 else 0
        self.hooks.rollout_end(self.index, tokens)
        return {"tokens": tokens, "generate_s": time.perf_counter() - t0}

    def cmd_rollout(self, region: WeightRegion | None, ids: np.ndarray, offsets: np.ndarray, n: int,
                    sampling, out: OutRegion, version: int | None = None) -> dict:
        """The rollout of split placement's loop (scheduler.py): load the newest
        published weights first when given (between rollouts, never inside one),
        then sample, streaming each finished part as `generate` does: the
        controller reads the rollout's lane during every wait (replies.Peers), so
        it decodes and scores the parts while this engine generates. Rollouts
        queue here (procs.serve.queued_commands reads commands as they come): up to
        --off-policy-steps of them run back to back. idle_s: how long this engine
        waited since its last rollout ended (for the next weights: the loop sends
        a rollout once it is admitted). version (--partial-rollouts): the weights'
        version after `region`; newer weights may come between decode steps
        (fleet/inflight_loads.py), and a region not newer than those held is
        not loaded again."""
        idle_s = 0.0 if self._idle_since is None else max(0.0, time.monotonic() - self._idle_since)
        loaded = self._load_first(region, version, haltable=True)
        self.hooks.rollout_begin(self.index)
        if version is not None and self.inbox is not None and offsets.size > 1 and \
                hasattr(self.engine, "generate_rounds"):  # tail fill (fleet/tail_fill.py)
            try:
                return run_rounds(self, RoundRequest(ids, offsets, n, sampling, version), out, loaded | {"idle_s": idle_s})
            finally:
                self._idle_since = time.monotonic()
        t1 = time.perf_counter()
        try:
            tokens = generate_into(self.engine, ids, offsets, n, sampling, out, self.emit) \
                if offsets.size > 1 else 0
        finally:
            loaded |= self.inflight.finish() if version is not None else {}
        self.hooks.rollout_end(self.index, tokens)
        self._idle_since = time.monotonic()
        return loaded | {"tokens": tokens, "idle_s": idle_s, "generate_s": time.perf_counter() - t1}

    def _load_first(self, region: WeightRegion | None, version: int | None, haltable: bool = False) -> dict:
        """A round's weights before it samples: `region` when given (under
        --partial-rollouts, `version`, only when newer than those held), then the
        in-flight loads begin (haltable: a round a halt ends: all but an agent's)."""
        if version is None:
            return self.cmd_load_region(region) if region is not None else {}
        loaded = self.cmd_load_region(region) if region is not None and self.inflight.newer(version) else {}
        self.inflight.begin(version, haltable)
        return loaded

    def cmd_episodes(self, region: WeightRegion | None, ids: np.ndarray, offsets: np.ndarray, n: int,
                     sampling, out: OutRegion, spec, states: list, share: tuple[int, int],
                     version: int | None = None) -> dict:
        """A multi-turn rollout of split placement: load `region` first when given (as
        cmd_rollout), then run the episode driver (envs/driver.py) here, beside the
        engine, with this process's own environment workers: every turn of every
        trajectory samples with the weights just loaded. Each group goes back as
        soon as its trajectories end, in a part with its arrays inline
        (response_mask, rewards; an agent's round: one part). share: (g, E),
        this engine's place among E: each generate call's seed becomes
        engine_sampling's, as the controller gives an engine group its seed
        (fleet/engines.py, PeerEngines._send), so one engine process samples what one
        colocated engine does. A failed environment under --on-reward-error fail
        comes back as `reward_error` (the controller raises it: the run's exit 2).
        An agent's spec (--agent-path) runs the gateway's driver instead
        (gateway/host.py, AgentEpisodes: its workers and gateway live here), and
        its part carries the prompts the agents' conversations chose.
        version: as cmd_rollout's (--partial-rollouts)."""
        from areno.envs.driver import EpisodeHost
        from areno.gateway.host import AgentEpisodes
        from areno.rewards.plugin import RewardError

        idle_s = 0.0 if self._idle_since is None else max(0.0, time.monotonic() - self._idle_since)
        # an environment's round is halted too (envs/halted.py: its trajectories' states go back
        # in its parts); an agent's conversations live in its own program, so it runs to its end
        loaded = self._load_first(region, version, haltable=not spec.agent)
        t1 = time.perf_counter()
        kind = AgentEpisodes if spec.agent else EpisodeHost
        if not isinstance(self._episodes, kind):
            if self._episodes is not None:
                self._episodes.close()
            self._episodes = kind()
        if offsets.size > 1 and version is not None and not spec.agent and self.inbox is not None:
            kw = dict(ids=ids, offsets=offsets, n=n, sampling=sampling, spec=spec, states=states, share=share,
                      version=version)
            return run_episode_rounds(self, kw, loaded | {"idle_s": idle_s})  # the rounds queued behind may join
        engine = SeedShare(self.engine, *share)
        try:
            if offsets.size > 1:
                if spec.agent:  # one part: an agent's conversations end as its gateway says
                    done = self._episodes.run(engine, spec, ids, offsets, states, n, sampling)
                    self.emit(episode_part(done, self.index))
                else:  # each group as its trajectories end (envs.driver._Driver.stream)
                    done = self._episodes.run(engine, spec, ids, offsets, states, n, sampling,
                                              emit=lambda part: self.emit(episode_part(part, self.index)))
        except RewardError as e:
            return loaded | {"reward_error": str(e), "tokens": 0, "idle_s": idle_s}
        finally:
            self._idle_since = time.monotonic()
            loaded |= self.inflight.finish() if version is not None else {}
        tokens = int(done.batch.response_ids.size) if offsets.size > 1 else 0
        return loaded | {"tokens": tokens, "idle_s": idle_s, "generate_s": time.perf_counter() - t1}

    def cmd_load_region(self, region: WeightRegion) -> dict:
        """Load the weights rank 0 published and check them (weight_sync.load_region)."""
        t0 = time.perf_counter()
        out = load_region(self.engine, region, self.sync_check)
        return out | {"load_s": time.perf_counter() - t0}
