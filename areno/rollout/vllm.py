"""vLLM rollout engine: token-id prompts in, a flat RolloutBatch out.

Requests ask for the sampled token's log-prob only (logprobs=0) in vLLM's flat
format (`SamplingParams(flat_logprobs=True)`: one list of floats per sequence
instead of a dict and a Logprob object per token) with detokenization off. The
LLM is created with logprobs_mode="processed_logprobs", so log-probs come from
the distribution actually sampled (after temperature / top-k / top-p).

On a CPU-only machine this module sets, before importing vLLM (setdefault, so
the user's values win): in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0),
no torch.compile (TORCH_COMPILE_DISABLE=1: ~20 s of inductor on the first
generate otherwise), and OMP_NUM_THREADS=1 on <= 2 cores.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    if (os.cpu_count() or 1) <= 2:
        os.environ.setdefault("OMP_NUM_THREADS", "1")

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from areno.rollout.batch import RolloutBatch, offsets_from_lengths, with_version  # noqa: E402
from areno.rollout.factory import check_vllm_version, select_vllm_runner  # noqa: E402
from areno.rollout.engine import (  # noqa: E402
    RoundRequest, SamplingConfig, prompt_seeds, validate_prompts, validate_sequence,
)
from areno.rollout.probe import Fingerprint, WeightSyncError  # noqa: E402
from areno.rollout.vllm_fingerprint import checkpoint_names, held_fingerprint  # noqa: E402
from areno.rollout.vllm_inflight import SwapLog, halt_requests  # noqa: E402
from areno.rollout.vllm_lora import VLLMAdapters, lora_llm_kwargs  # noqa: E402
from areno.rollout.vllm_rounds import stream_rounds  # noqa: E402
from areno.rollout.vllm_outputs import FlatLogprobs, batch_from_request_outputs  # noqa: E402

HAS_FLAT_LOGPROBS = FlatLogprobs is not None and hasattr(SamplingParams(), "flat_logprobs")
# Default KV cache on CPU when the caller gives none: vLLM would claim most RAM.
CPU_KV_CACHE_BYTES = 512 << 20
# Whole prefills on CPU: vLLM rewinds a seeded request's generator after a prefill
# chunk, which torch's CPU Generator cannot ("CPU Generator does not use offset"),
# and areno seeds every request. Unchunked, vLLM's budget becomes max_model_len.
CPU_SCHEDULING = {"enable_chunked_prefill": False}
# Level 2 frees the weights too (level 1 keeps a host copy); see VLLMEngine.sleep.
SLEEP_LEVEL = 2


def flat_logprobs_facility() -> str:
    """Which flat log-prob facility the installed vLLM offers (for reports)."""
    if HAS_FLAT_LOGPROBS:
        return f"SamplingParams(flat_logprobs=True) -> vllm.logprobs.FlatLogprobs (vLLM {vllm.__version__})"
    return f"none: list[dict[int, Logprob]] per sequence (vLLM {vllm.__version__})"


class VLLMEngine:
    """RolloutEngine over an in-process `vllm.LLM`.

    model: HF directory or hub id. dtype: "auto", "float32", "bfloat16", ...
    max_model_len: prompt + response token limit (None: the model's).
    gpu_memory_utilization: GPU share for weights + KV cache (GPU only).
    kv_cache_memory_bytes: explicit KV cache size; on CPU it defaults to
        CPU_KV_CACHE_BYTES. enable_sleep_mode: needed for sleep()/wake_up() on GPU.
    max_lora_rank: > 0 serves LoRA adapters up to that rank (`load_adapter`;
        see rollout.vllm_lora).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool = True,
        max_lora_rank: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        from vllm.platforms import current_platform

        check_vllm_version(vllm.__version__)
        select_vllm_runner()  # read by vLLM when LLM() builds its config
        on_cpu = current_platform.is_cpu()
        if on_cpu and kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        given = dict(max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                     kv_cache_memory_bytes=kv_cache_memory_bytes, **(CPU_SCHEDULING if on_cpu else {}))
        self.llm = LLM(
            model=str(model), tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            logprobs_mode="processed_logprobs", enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=enable_sleep_mode and not on_cpu,
            **{k: v for k, v in given.items() if v is not None},  # else vLLM's own defaults
            **(lora_llm_kwargs(max_lora_rank) if max_lora_rank > 0 else {}), **llm_kwargs)
        # What vLLM chose from VLLM_USE_V2_MODEL_RUNNER (rollout.factory.select_vllm_runner).
        self.runner = "V2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "V1"
        self.note = f"vLLM {vllm.__version__}, {self.runner} model runner"
        print(f"areno: engine {self.note}", file=sys.stderr, flush=True)  # run.log
        mc = self.llm.llm_engine.model_config
        self.adapters = VLLMAdapters(self.llm, max_lora_rank, mc.dtype) if max_lora_rank > 0 else None
        self.max_model_len: int = int(mc.max_model_len)
        self.vocab_size: int = int(mc.get_vocab_size())
        self.supports_sleep: bool = bool(
            enable_sleep_mode and current_platform.is_sleep_mode_available() and not on_cpu
        )
        # Tensors can be handed to the worker only when it lives in this process
        # (in-process engine core, one worker); otherwise they go through a file.
        # external_launcher (an engine inside each training rank) is in-process at any TP size.
        pc = self.llm.llm_engine.vllm_config.parallel_config
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" and (
            int(pc.world_size) == 1 or pc.distributed_executor_backend == "external_launcher")
        self.multiprocess: bool = not in_process
        self._weight_names, self._optional_names = checkpoint_names(mc)
        self._asleep = False
        self._discarded = False  # level-2 sleep freed weights and KV cache; a full load restores them
        # In-flight updates (rollout.vllm_inflight): step_hook(steps done) runs between
        # engine steps; weight_version (None: not told) tags every token sampled.
        self.step_hook: Callable[[int], None] | None = None
        self.halt = False  # set by step_hook: every request ends at this step boundary (finish "abort")
        self.cut_version: int | None = None  # set by step_hook: due rounds end (rollout.engine.due)
        self.cut_samples = 0
        self.weight_version: int | None = None
        self._swaps: SwapLog | None = None  # the generation in progress, while a hook may swap

    # -- sampling ------------------------------------------------------------
    def generate(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig
    ) -> RolloutBatch:
        if self.step_hook is not None:  # step by step, so the hook runs between steps
            parts = list(self.generate_stream(prompt_ids, prompt_offsets, n, sampling))
            return RolloutBatch.merge_parts([b for _, b in parts], [p for p, _ in parts])[0]
        ids, offsets, _, prompts, params = self._requests(prompt_ids, prompt_offsets, n, sampling)
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora())
        batch = batch_from_request_outputs(outputs, ids, offsets, n)
        return batch if self.weight_version is None else with_version(batch, self.weight_version)

    def generate_stream(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig,
        min_groups: int = 1,
    ) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        """Yield (prompt positions [p] int64, RolloutBatch of those p groups) as
        groups finish, at least `min_groups` at a time (fewer only at the end), so
        the caller can decode and score them while the rest are still generating.
        Concatenated and put back in prompt order, the parts equal generate()."""
        _, offsets, pieces, prompts, params = self._requests(prompt_ids, prompt_offsets, n, sampling)
        req_ids = self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self._lora())
        # enqueue returns "<counter>-<suffix>"; finished outputs carry "<counter>".
        position = {rid.split("-", 1)[0]: i for i, rid in enumerate(req_ids)}
        engine = self.llm.llm_engine
        done: list[Any] = []
        self._swaps, steps = SwapLog(self.weight_version), 0

        def part(outs: list[Any]) -> tuple[np.ndarray, RolloutBatch]:
            pos = np.fromiter((position[o.request_id] for o in outs), np.int64, len(outs))
            sub_ids = np.concatenate([pieces[i] for i in pos.tolist()])
            batch = batch_from_request_outputs(outs, sub_ids, offsets_from_lengths(np.diff(offsets)[pos]), n)
            return pos, self._swaps.stamp(batch, [req_ids[p] for p in pos.tolist()], n)
        try:
            while engine.has_unfinished_requests():
                done += [o for o in engine.step() if o.finished]
                steps += 1
                if len(done) >= min_groups or (done and not engine.has_unfinished_requests()):
                    yield part(done)
                    done = []
                if self.step_hook is not None and engine.has_unfinished_requests():
                    self.step_hook(steps)
                    if self.halt:  # the run is saving: every request ends now with its tokens
                        yield part(done + halt_requests(engine))
                        return
        finally:
            self._swaps = None

    def generate_rounds(self, first: RoundRequest, admit: Callable[[int], RoundRequest | None],
                        ) -> Iterator[tuple[int, np.ndarray, RolloutBatch]]:
        """Tail fill: `first`, then the rounds `admit` adds between steps, in one
        loop (rollout.vllm_rounds.stream_rounds): (round, positions, part) as groups finish."""
        return stream_rounds(self, first, admit)

    def _requests(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int,
                  sampling: SamplingConfig) -> tuple[np.ndarray, np.ndarray, list, list, Any]:
        """Checked inputs -> (ids, offsets, per-prompt id views, vLLM prompts, params)."""
        self._check_awake()
        ids, offsets = validate_prompts(
            prompt_ids, prompt_offsets, n, max_model_len=self.max_model_len, vocab_size=self.vocab_size
        )
        from vllm.inputs import TokensPrompt

        pieces = np.split(ids, offsets[1:-1])
        # O(prompts): vLLM takes each prompt as a list of ints.
        prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in pieces]
        return ids, offsets, pieces, prompts, self._sampling_params(n, sampling, len(prompts))

    def _sampling_params(self, n: int, s: SamplingConfig, num_prompts: int) -> SamplingParams | list[SamplingParams]:
        kw: dict[str, Any] = dict(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k_enabled else -1,
            max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )
        if HAS_FLAT_LOGPROBS:
            kw["flat_logprobs"] = True
        if s.seed is None:
            return SamplingParams(**kw)
        # One request per prompt: a shared seed would give every prompt the same stream.
        return [SamplingParams(seed=int(x), **kw) for x in prompt_seeds(s.seed, num_prompts)]

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        """[L] ids -> [L-1] float32 at temperature 1 (vLLM's prompt log-probs skip
        the sampling processors)."""
        self._check_awake()
        ids = validate_sequence(ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        from vllm.inputs import TokensPrompt

        kw: dict[str, Any] = dict(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        if HAS_FLAT_LOGPROBS:
            kw["flat_logprobs"] = True
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids.tolist())], SamplingParams(**kw),
                                use_tqdm=False, lora_request=self._lora())[0]
        plp = out.prompt_logprobs
        if FlatLogprobs is not None and isinstance(plp, FlatLogprobs):
            # Position 0 is empty (no prefix); every other position holds the prompt token first.
            first = np.asarray(plp.start_indices[1:], dtype=np.int64)
            return np.asarray(plp.logprobs, dtype=np.float32)[first]
        tok = ids[1:].tolist()
        return np.array([d[t].logprob for d, t in zip(plp[1:], tok)], dtype=np.float32)

    # -- weights -------------------------------------------------------------
    def update_weights_inflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load weights of `version` now: between generates, or between engine steps
        (from step_hook), where the requests held keep going: they are preempted and
        their prompt and tokens prefilled again under the new weights (vllm_inflight),
        and every token sampled from here on carries `version`."""
        self._check_awake(loading=True)
        core = self._inproc_core("update_weights_inflight")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self._finish_wake()
        self._restore_adapter()
        if self._swaps is not None:
            self._swaps.record(core, version)
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise WeightSyncError("vLLM refused to reset its KV cache after an in-flight update")
        self.weight_version = int(version)

    def _inproc_core(self, what: str) -> Any:
        """The in-process engine core (tensors reach only such a worker); RuntimeError naming `what`."""
        if self.multiprocess:
            raise RuntimeError(f"VLLMEngine.{what} needs an in-process engine")
        return self.llm.llm_engine.engine_core.engine_core

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream a full set of HF-named tensors (any device) into the in-process
        model, one at a time, then reset the prefix cache. Names are checked once,
        up front, by the caller (see fleet.weight_sync.check_engine_names)."""
        self._check_awake(loading=True)
        self._inproc_core("load_weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self._finish_wake()
        self._restore_adapter()
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("vLLM refused to reset its prefix cache (requests still running)")

    @property
    def fingerprint_exact(self) -> bool:
        """An engine of one rank holds whole tensors; a TP shard does not (its
        sums would need the group's, issue 20): it is checked by the probe alone."""
        return int(self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size) == 1

    def weights_fingerprint(self) -> Fingerprint:
        """Per module group, the fp64 sum of squares of what the worker's model
        holds (see rollout.probe and rollout.vllm_fingerprint)."""
        self._check_awake()
        return self.llm.apply_model(held_fingerprint)[0]

    # -- LoRA adapter (rollout.vllm_lora) ----------------------------------------
    def load_adapter(self, tensors: Mapping[str, torch.Tensor], config: Any, version: int,
                     inflight: int | None = None) -> None:
        """Serve this adapter (peft names, LoraConfig) as "areno-v<version>" (strictly
        increasing), the previous one removed. inflight: the weight version of a load
        between engine steps, the requests held kept (vllm_lora.VLLMAdapters.load)."""
        self._check_awake()
        core = None if inflight is None else self._inproc_core("load_adapter(inflight=...)")
        if core is not None and self._swaps is not None:
            self._swaps.record(core, inflight)
        self._lora_on().load(tensors, config, version, running=core)
        self.weight_version = self.weight_version if inflight is None else int(inflight)

    def adapter_fingerprint(self) -> Fingerprint:
        """What the engine serves now (rollout.lora): A and scaled B of the
        current adapter's slot; empty when it serves none."""
        self._check_awake()
        return self._lora_on().fingerprint()

    @property
    def adapter_dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def _lora_on(self) -> VLLMAdapters:
        if self.adapters is None:
            raise RuntimeError("VLLMEngine: built without LoRA (max_lora_rank=0)")
        return self.adapters

    def _lora(self) -> Any:
        return None if self.adapters is None else self.adapters.request

    def _restore_adapter(self) -> None:
        """A base-weight reload removes every adapter (vLLM's reset_lora_state)."""
        if self.adapters is not None:
            self.adapters.restore()

    # -- lifecycle -----------------------------------------------------------
    def sleep(self) -> None:
        """Free the KV cache and the weights (vLLM level 2) while the trainer
        runs. Level 1 would copy the weights to host memory and back every step,
        though the sync after training overwrites them all (reload_weights).
        Serving LoRA the base never changes and is never sent again, so it stays
        on the device with the adapter's slots: scheduling paused (level 0) and
        only the KV cache released (vLLM's release_kv_cache_memory), not level 1's
        copy of the base out and back every step. A no-op where sleep mode is
        unsupported (CPU); see `supports_sleep`."""
        if self.supports_sleep and not self._asleep:
            if self.adapters is not None:
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
            else:
                self.llm.sleep(level=SLEEP_LEVEL)
            self._asleep, self._discarded = True, self.adapters is None

    def wake_up(self) -> None:
        """Reallocate the weights only (uninitialised); the next full load fills
        them, then wakes the KV cache (`_finish_wake`): vLLM's order for updates.
        Serving LoRA: the KV cache back, then scheduling; base and adapter never left."""
        if self.supports_sleep and self._asleep:
            if self.adapters is not None:
                self.llm.wake_up(tags=["kv_cache"])
                self.llm.wake_up(tags=["scheduling"])
            else:
                self.llm.wake_up(tags=["weights"])
        self._asleep = False

    def _finish_wake(self) -> None:
        """After a full load: the KV cache back (vLLM then resumes scheduling)."""
        if self._discarded:
            self.llm.wake_up(tags=["kv_cache"])
            self._discarded = False

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()

    def _check_awake(self, loading: bool = False) -> None:
        if self.llm is None:
            raise RuntimeError("VLLMEngine: used after shutdown()")
        if self._asleep:
            raise RuntimeError("VLLMEngine: asleep; call wake_up() first")
        if self._discarded and not loading:
            raise RuntimeError("VLLMEngine: sleep() freed the weights; load a full set before sampling")

