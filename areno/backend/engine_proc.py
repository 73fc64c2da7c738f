"""Split placement: rollout engines in processes of their own, beside the ranks.

With `BackendConfig.rollout_world_size` M > 0 the controller spawns M engine
processes after the N ranks (launch.spawn_peers). Each runs the rank process's
command loop (rank.serve) around an `EngineWorker` instead of a RankWorker: it
trains nothing and joins no process group. On CPU the processes share the
cores; on GPU engine i takes GPU N + i of the controller's (BackendConfig.engine_gpus
to place it elsewhere), the only one it sees (launch.peer_env sets its
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
does (backend.adapter_sync). Its heartbeat and sentinel are watched with the ranks'.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from areno.backend.config import BackendConfig
from areno.procs.device import claim_device
from areno.fleet.engine_host import OutRegion, generate_into
from areno.backend.hooks import load_rank_hooks
from areno.fleet.weight_sync import SyncCheck, WeightRegion, load_region, reports_fingerprint
from areno.rollout.engine import engine_sampling
from areno.rollout.factory import make_engine


class EngineWorker:
    """One engine process: peer index `ARENO_PEER_INDEX` (N + i) of the controller."""

    def __init__(self, cfg: BackendConfig, *, same_host: bool = True) -> None:
        self.cfg = cfg
        self.peer = int(os.environ["ARENO_PEER_INDEX"])
        self.index = self.peer - cfg.world_size  # i of the M engine processes
        self.same_host = same_host
        # GPU: device 0, the one GPU it sees (launch.peer_env: GPU N + i of the
        # controller's). TP inside one is refused (config/offpolicy.py).
        self.device = claim_device(cfg.device, cfg.cpu_threads, 0, cfg.rollout_world_size)
        self.hooks = load_rank_hooks()  # no-ops unless ARENO_RANK_HOOKS names some (benchmarks)
        made = self.hooks.make_engine(cfg, self.device)  # None but in benchmarks (hooks.py)
        self.engine, self.engine_kind = made if made is not None else \
            make_engine(cfg.engine, cfg.model_path, self.device)
        self.sync_check = SyncCheck(reports_fingerprint(self.engine), self.peer)
        self.emit = None  # set by serve(): sends one ("part", ...) message mid-command
        self._idle_since: float | None = None  # the end of the last rollout (cmd_rollout)
        self._episodes = None  # envs.driver.EpisodeHost, at the first `episodes` command

    def hello(self) -> dict:
        return {"rank": self.peer, "pid": os.getpid(), "host": os.uname().nodename, "same_host": self.same_host,
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
        self.hooks.rollout_begin(self.peer)
        tokens = generate_into(self.engine, ids, offsets, n, sampling, out, self.emit) if offsets.size > 1 else 0
        self.hooks.rollout_end(self.peer, tokens)
        return {"tokens": tokens, "generate_s": time.perf_counter() - t0}

    def cmd_rollout(self, region: WeightRegion | None, ids: np.ndarray, offsets: np.ndarray, n: int,
                    sampling, out: OutRegion) -> dict:
        """The rollout of split placement's loop (scheduler.py): load the newest
        published weights first when given (between rollouts, never inside one),
        then sample, streaming each finished part as `generate` does: the
        controller reads the rollout's lane during every wait (replies.Peers), so
        it decodes and scores the parts while this engine generates. Rollouts
        queue here (rank.serve reads commands as they come): up to
        --off-policy-steps of them run back to back. idle_s: how long this engine
        waited since its last rollout ended (for the next weights: the loop sends
        a rollout once it is admitted)."""
        idle_s = 0.0 if self._idle_since is None else max(0.0, time.monotonic() - self._idle_since)
        loaded = self.cmd_load_region(region) if region is not None else {}
        t1 = time.perf_counter()
        self.hooks.rollout_begin(self.peer)
        tokens = generate_into(self.engine, ids, offsets, n, sampling, out, self.emit) if offsets.size > 1 else 0
        self.hooks.rollout_end(self.peer, tokens)
        self._idle_since = time.monotonic()
        return loaded | {"tokens": tokens, "idle_s": idle_s, "generate_s": time.perf_counter() - t1}

    def cmd_episodes(self, region: WeightRegion | None, ids: np.ndarray, offsets: np.ndarray, n: int,
                     sampling, out: OutRegion, spec, states: list, share: tuple[int, int]) -> dict:
        """A multi-turn rollout of split placement: load `region` first when given (as
        cmd_rollout), then run the episode driver (envs/driver.py) here, beside the
        engine, with this process's own environment workers: every turn of every
        trajectory samples with the weights just loaded. The whole rollout goes back
        as one part with its arrays inline (response_mask, rewards). share: (g, E),
        this engine's place among E: each generate call's seed becomes
        engine_sampling's, as the controller gives an engine group its seed
        (rank_engines.RankEngines._send), so one engine process samples what one
        colocated engine does. A failed environment under --on-reward-error fail
        comes back as `reward_error` (the controller raises it: the run's exit 2)."""
        from areno.envs.driver import EpisodeHost
        from areno.rewards.plugin import RewardError

        idle_s = 0.0 if self._idle_since is None else max(0.0, time.monotonic() - self._idle_since)
        loaded = self.cmd_load_region(region) if region is not None else {}
        t1 = time.perf_counter()
        self._episodes = self._episodes or EpisodeHost()
        engine = _SeedShare(self.engine, *share)
        try:
            if offsets.size > 1:
                done = self._episodes.run(engine, spec, ids, offsets, states, n, sampling)
                self.emit(episode_part(done))
        except RewardError as e:
            return loaded | {"reward_error": str(e), "tokens": 0, "idle_s": idle_s}
        finally:
            self._idle_since = time.monotonic()
        tokens = int(done.batch.response_ids.size) if offsets.size > 1 else 0
        return loaded | {"tokens": tokens, "idle_s": idle_s, "generate_s": time.perf_counter() - t1}

    def cmd_load_region(self, region: WeightRegion) -> dict:
        """Load the weights rank 0 published and check them (weight_sync.load_region)."""
        t0 = time.perf_counter()
        out = load_region(self.engine, region, self.sync_check)
        return out | {"load_s": time.perf_counter() - t0}


def episode_part(done) -> dict:
    """An EnvRollout -> the part message of cmd_episodes: its arrays inline (whole
    buffers), the rewards and counts, the env/* metrics, the texts to display."""
    b, sc = done.batch, done.scored
    return dict(positions=np.arange(b.num_prompts, dtype=np.int64), lengths=np.diff(b.response_offsets),
                finish=b.finish_reason, start=0, ids=b.response_ids, logprobs=b.response_logprobs,
                mask=b.response_mask, rewards=sc.rewards, valid=sc.valid, counts=sc.counts,
                messages=sc.messages, env=done.metrics(), turns=done.turns)


class _SeedShare:
    """An engine whose generate calls sample as engine g of E does under the
    controller's split (rollout.engine.engine_sampling)."""

    def __init__(self, engine, g: int, num: int) -> None:
        self.engine, self.g, self.num = engine, g, num
        self.max_model_len = engine.max_model_len

    def generate_stream(self, ids, offsets, n, sampling, min_groups: int = 1):
        return self.engine.generate_stream(ids, offsets, n, engine_sampling(sampling, self.g, self.num),
                                           min_groups=min_groups)
