"""RankWorker: what one rank holds (process group, wrapped policy, optimizer)
and the commands the controller sends it (`cmd_*`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from areno.backend.config import BackendConfig
from areno.procs.device import claim_device
from areno.rundir.rng import rng_state, set_rng_state
from areno.rollout.budget import check_engine_budget, footprint
from areno.rollout.factory import make_engine
from areno.fleet.engine_host import OutRegion, generate_into
from areno.backend.handoff import LocalPack, RankHandoff
from areno.procs.segment import map_region
from areno.backend.hooks import load_rank_hooks
from areno.fleet.adapter_sync import adapter_tensors, load_adapter
from areno.backend.lora import (
    ADAPTER, adapter_meta, adapter_state, apply_lora, head_weight, merged_state, param_counts, save_adapter,
)
from areno.backend.model import PolicyModule, load_hf_model, resolve_attn_implementation, wrap_policy
from areno.backend.step import RankTrainer, autocast_ctx
from areno.fleet.weight_sync import (
    ProbeRef, SyncCheck, WeightLayout, WeightStream, check_engine_names, reports_fingerprint,
)
from areno.backend.weights import copy_aux_files, hf_state_names, iter_full_state, save_hf_dir, state_meta
from areno.perf import flop_shape
from areno.rollout.lora import adapter_fingerprint_of
from areno.rollout.probe import Fingerprint, probe_scale, reduction_length, rounding_unit


class RankWorker:
    """Built once per rank; reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* from the env."""

    def __init__(self, cfg: BackendConfig, *, same_host: bool = True) -> None:
        self.cfg = cfg
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.same_host = same_host
        self.device = claim_device(cfg.device, cfg.cpu_threads, self.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
        if not dist.is_initialized():
            dist.init_process_group(
                cfg.dist_backend, rank=self.rank, world_size=self.world,
                timeout=timedelta(seconds=cfg.collective_timeout_s),
            )
        torch.manual_seed(cfg.seed)
        attn = resolve_attn_implementation(cfg)
        hf = load_hf_model(cfg.model_path, attn, self.device)
        self.hf_config = hf.config
        self.vocab_size = int(hf.config.get_text_config().vocab_size)
        self.export_names = hf_state_names(hf)  # the base model's names (LoRA: merged on export)
        self.export_meta = state_meta(hf, cfg.dtype)  # the engines' dtype: what a sync sends
        self.flop_shape = flop_shape(hf)  # before FSDP2 turns the weights into DTensors
        self.num_params = sum(p.numel() for p in hf.parameters())
        if cfg.lora is not None:  # adapters in, base frozen; before any wrapper
            hf = apply_lora(hf, cfg.lora, cfg.model_path, cfg.lora.adapter_path)
            self.export_meta = adapter_meta(hf, cfg.dtype)  # a sync sends the adapter only
        self.hf = hf
        self.trainable_params, _ = param_counts(hf)
        self.wrapped = wrap_policy(PolicyModule(hf, cfg.logprob_chunk_size), cfg, self.device)
        ref = None
        if cfg.needs_ref_model:
            ref_hf = load_hf_model(cfg.ref_model_path or cfg.model_path, attn, self.device)
            ref_hf.requires_grad_(False)
            ref = wrap_policy(PolicyModule(ref_hf, cfg.logprob_chunk_size), cfg, self.device, trainable=False)
        self.trainer = RankTrainer(cfg, self.wrapped, self.device, ref)
        self.hooks = load_rank_hooks()  # no-ops unless ARENO_RANK_HOOKS names some (benchmarks)
        self.emit = None  # set by serve(): sends one ("part", ...) message mid-command
        self.engine, self.engine_kind = None, None
        self.sync_check: SyncCheck | None = None  # this rank's engine's checks (weight_sync.py)
        if cfg.engine is not None and not cfg.rollout_world_size:  # split: engine processes build it
            # Before the engine claims its share: the AdamW states do not exist yet.
            check_engine_budget(cfg.engine, self.device, footprint(*filter(None, (self.wrapped.root, ref))),
                                self.num_params, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
            self.engine, self.engine_kind = make_engine(cfg.engine, cfg.model_path, self.device, in_rank=True)
            check_engine_names(self.engine, self.export_names)
            self.sync_check = SyncCheck(reports_fingerprint(self.engine), self.rank)

    def hello(self) -> dict:
        return {
            "rank": self.rank, "pid": os.getpid(), "host": os.uname().nodename, "same_host": self.same_host,
            "vocab_size": self.vocab_size, "weights": self.export_meta if self.rank == 0 else None,
            "strategy": self.wrapped.strategy, "engine": self.engine_kind,
            "engine_max_model_len": getattr(self.engine, "max_model_len", None),
            "engine_note": getattr(self.engine, "note", None),  # vLLM's release and model runner
            # for perf/mfu in the controller, which never touches CUDA
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "flop_shape": self.flop_shape, "cpu_threads": torch.get_num_threads(),
            "params": self.num_params, "trainable_params": self.trainable_params,
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- commands ------------------------------------------------------------
    def cmd_train(self, handoff: RankHandoff, payload: bytearray | None = None) -> dict:
        self.hooks.train_begin(self.rank)
        t0 = time.perf_counter()
        local = LocalPack(handoff, payload)
        if self.device.type == "cuda":  # perf/peak_gpu_mem_gb is this train phase's, not the run's
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.engine is not None:  # its KV cache (and, on GPU, weights) make room for training
            self.engine.sleep()
        t1 = time.perf_counter()
        steps = self.trainer.train(local, self.hooks)
        t2 = time.perf_counter()
        if self.engine is not None:
            self.engine.wake_up()
        out = {"steps": steps, "map_s": t1 - t0, "train_s": t2 - t1}
        if self.device.type == "cuda":  # allocator counters: host-side, no device sync
            out["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.hooks.train_end(self.rank, local, out)
        return out

    def cmd_generate(self, ids: np.ndarray, offsets: np.ndarray, n: int, sampling,
                     out: OutRegion, leader: bool) -> dict:
        """Sample this engine group's prompts; the leader streams finished parts
        back (see engine_host.generate_into)."""
        t0 = time.perf_counter()
        tokens = 0
        if offsets.size > 1:
            tokens = generate_into(self.engine, ids, offsets, n, sampling, out,
                                   self.emit if leader else None)
        return {"tokens": tokens, "generate_s": time.perf_counter() - t0}

    @torch.no_grad()
    def cmd_sync_weights(self, probe_ids: np.ndarray) -> dict:
        """In-process transport (weight_sync.py): every rank gathers the full weights
        tensor by tensor straight into its own engine (same device), then checks
        what the engine holds (fingerprint) and computes (probe, when due)
        against this rank's trainer, in the dtype both compute in."""
        t0 = time.perf_counter()
        check = self.sync_check
        if self.cfg.lora is not None:  # the base is in the engine already: only the adapter travels
            sent, info = load_adapter(self.engine, adapter_state(self.hf),
                                      self.hf.areno_peft.peft_config[ADAPTER], check.syncs + 1)
            held, nbytes = (self.engine.adapter_fingerprint() if check.fingerprinted else None), info["adapter_bytes"]
        else:
            stream = WeightStream(self.full_state(self._engine_dtype), self._engine_dtype,
                                  fingerprint=check.fingerprinted)
            self.engine.load_weights(stream)
            sent, held, nbytes = (stream.fingerprint() if check.fingerprinted else None), None, stream.nbytes
        t1 = time.perf_counter()
        probe = self._probe_ref(probe_ids) if check.probe_due else None
        out = check.check(self.engine, sent, probe, held=held)
        return out | {"load_s": t1 - t0, "probe_s": time.perf_counter() - t1, "sync_bytes": nbytes}

    @torch.no_grad()
    def cmd_publish_weights(self, segment: str | None, layout: WeightLayout,
                            probe_ids: np.ndarray | None) -> dict | None:
        """Shared-memory transport (weight_sync.py): every rank gathers; rank 0 writes
        the full weights (under LoRA the adapter alone) into `segment` with `layout`
        and returns what a reader checks them against: {fingerprint, probe (a
        ProbeRef when probe_ids are given), adapter (the peft LoraConfig, under
        LoRA), gather_s, probe_s} (+ payload, the region's bytes, when segment is
        None: a controller on another host)."""
        t0 = time.perf_counter()
        mem = None
        if self.rank == 0:
            mem = map_region(segment, 0, layout.nbytes, writable=True) if segment else bytearray(layout.nbytes)
        fingerprint, adapter = self._write_region(mem, layout)
        if segment and mem is not None:
            mem.close()
        t1 = time.perf_counter()
        # The trainer forward is a collective too (FSDP2): every rank runs it.
        probe = self._probe_ref(probe_ids) if probe_ids is not None else None
        if self.rank != 0:
            return None
        out = {"fingerprint": fingerprint, "probe": probe, "adapter": adapter, "gather_s": t1 - t0,
               "probe_s": time.perf_counter() - t1}
        return out if segment else out | {"payload": bytes(mem)}

    def _write_region(self, mem: Any, layout: WeightLayout) -> tuple[Fingerprint | None, Any]:
        """Every rank gathers what a sync sends, rank 0 (`mem` not None) writes it ->
        (its fingerprint, the adapter's LoraConfig or None); (None, None) elsewhere."""
        dtype = self._engine_dtype
        lora = self.cfg.lora is not None  # the engines hold the base: only the adapter travels
        named = adapter_state(self.hf) if lora else WeightStream(self.full_state(dtype), dtype,
                                                                 fingerprint=mem is not None)
        if mem is None:
            for _ in named:  # FSDP2 gathers are collectives: every rank joins each
                pass
            return None, None
        if not lora:
            layout.write(mem, named)
            return named.fingerprint(), None
        config = self.hf.areno_peft.peft_config[ADAPTER]
        tensors = adapter_tensors(named, dtype)
        layout.write(mem, tensors.items())
        return adapter_fingerprint_of(tensors, config), config

    @property
    def _engine_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32

    def _probe_ref(self, probe_ids: np.ndarray) -> ProbeRef:
        """The trainer's log-probs of the probe sequence under its current weights
        (the engine must reproduce them: weight_sync.SyncCheck) and their rounding unit."""
        ids = torch.from_numpy(probe_ids.astype(np.int64)).to(self.device)
        with autocast_ctx(self.cfg, self.wrapped.strategy), logit_scale_of(self.hf) as scales:
            ref, _ = self.wrapped.root(ids[None, :-1], torch.arange(ids.numel() - 1, device=self.device)[None],
                                       ids[None, 1:])
        if hasattr(self.wrapped.root, "reshard"):
            # FSDP2 keeps the root unsharded after a forward (backward would need it);
            # there is no backward here, and the state walk (save, export) wants shards.
            self.wrapped.root.reshard()
        ref = ref[0].float().cpu().numpy()
        scale = probe_scale(scales[0], ref)
        unit = rounding_unit(self.cfg.dtype, scale, reduction_length(self.hf_config))
        return ProbeRef(np.ascontiguousarray(probe_ids, dtype=np.int32), ref, unit, scale)

    def full_state(self, dtype: torch.dtype | None = None):
        """(HF name, full tensor) of the full model: the weights, or under LoRA the
        merged base + adapter weights (lora.merged_state: --save-merged; a LoRA
        engine gets only the adapter, cmd_sync_weights). dtype: what the caller
        converts to anyway (the engines'): shards are cast before their gather."""
        if self.cfg.lora is not None:
            return merged_state(self.hf, self.export_names)
        return iter_full_state(self.hf, self.export_names, dtype)

    def cmd_save_pretrained(self, path: str) -> None:
        """The model in HF format; under LoRA the adapter in peft's format instead (and,
        with save_merged, the merged model in merged/)."""
        lora = self.cfg.lora
        if lora is not None:
            tensors = {n: t.to("cpu", copy=True) for n, t in adapter_state(self.hf)}
            if self.rank == 0:
                save_adapter(self.hf, lora, self.cfg.model_path, tensors, Path(path))
                copy_aux_files(Path(self.cfg.model_path), Path(path))
        if lora is None or lora.save_merged:
            out = Path(path) if lora is None else Path(path) / "merged"
            full = self.full_state()
            if self.rank == 0:
                cpu = ((n, t.to("cpu", copy=True)) for n, t in full)
                save_hf_dir(self.hf_config, cpu, out, Path(self.cfg.model_path))
            else:
                for _ in full:
                    pass
        dist.barrier()

    def cmd_save_state(self, path: str) -> None:
        """Optimizer (sharded, torch.distributed.checkpoint), schedule/step, per-rank RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd = get_optimizer_state_dict(self.wrapped.root, self.trainer.optimizer)
        dcp.save({"optim": osd}, checkpoint_id=os.path.join(path, "optim"))
        if self.rank == 0:
            torch.save(self.trainer.state() | {"world_size": self.world}, os.path.join(path, "trainer.pt"))
        torch.save(rng_state(self.device), os.path.join(path, f"rng_rank{self.rank}.pt"))
        dist.barrier()

    def cmd_load_state(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        osd = get_optimizer_state_dict(self.wrapped.root, self.trainer.optimizer)
        state = {"optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(path, "optim"))
        set_optimizer_state_dict(self.wrapped.root, self.trainer.optimizer, state["optim"])
        self.trainer.load(torch.load(os.path.join(path, "trainer.pt"), weights_only=False))
        rng = os.path.join(path, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng):  # absent when resuming on more ranks than were saved
            set_rng_state(torch.load(rng, weights_only=False), self.device)
        dist.barrier()


@contextmanager
def logit_scale_of(hf: torch.nn.Module) -> Iterator[list[float]]:
    """Within: every forward of `hf.model` appends max |logit| of its last hidden
    states through `hf.lm_head` (the probe's rounding scale). Read inside the
    forward, where FSDP2 has gathered the lm_head and autocast is on."""
    scales: list[float] = []

    def grab(_module, _args, out) -> None:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        with torch.no_grad():
            scales.append(float(torch.nn.functional.linear(h, head_weight(hf.lm_head)).abs().max()))

    handle = hf.model.register_forward_hook(grab)
    try:
        yield scales
    finally:
        handle.remove()
