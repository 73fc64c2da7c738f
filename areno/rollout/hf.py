"""transformers rollout engine: the fallback where vLLM is absent, and a second
opinion in tests. Same contract as VLLMEngine.

Prompts of every length are sampled in one `generate`, left-padded with an
attention mask (positions follow the mask, so each row computes what its
unpadded forward would, to float rounding). Log-probs are the log-softmax of
the processed scores (after temperature / top-k / top-p), i.e. of the
distribution actually sampled, recorded step by step (hf_logprobs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from areno.rollout.batch import (
    FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RolloutBatch, csr_take, offsets_from_lengths, segment_gather,
)
from areno.rollout.engine import (
    RoundRequest,
    SamplingConfig,
    prompt_seeds,
    validate_prompts,
    validate_sequence,
)
from areno.rollout.hf_inflight import StepBoundary, prefill, stack_rows
from areno.rollout.hf_logprobs import StepLogprobs, sampling_processors
from areno.rollout.hf_lora import HFAdapters, base_named
from areno.rollout.probe import Fingerprint, WeightSyncError, probe_logprobs, sum_squares

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """RolloutEngine over `AutoModelForCausalLM.generate`.

    model: HF directory or hub id. dtype: "auto" (the checkpoint's), "float32",
    "bfloat16", "float16". device: None picks cuda if available. max_model_len:
    prompt + response limit (None: config.max_position_embeddings). sleep:
    whether sleep() frees the weights (None: on CUDA only, where the trainer
    needs the memory; tests turn it on for CPU to run the same branch).
    max_lora_rank: > 0 serves a LoRA adapter up to that rank (`load_adapter`;
    rollout.hf_lora); sleep() then keeps the (frozen) base weights.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
        sleep: bool | None = None,
        max_lora_rank: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r}: valid: auto, {', '.join(_DTYPES)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model), dtype="auto" if dtype == "auto" else _DTYPES[dtype]
        ).to(self.device)
        self.model.eval()
        cfg = self.model.config
        self.max_model_len: int = int(max_model_len or getattr(cfg, "max_position_embeddings", 2048))
        self.vocab_size: int = int(cfg.get_text_config().vocab_size)
        gen = getattr(self.model, "generation_config", None) or GenerationConfig()
        eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            int(e) for e in ([] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos])
        )
        pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(cfg, "pad_token_id", None)
        self.pad_token_id: int = int(pad if pad is not None else (self.eos_token_ids or (0,))[0])
        self.seed = seed
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self.supports_sleep: bool = self.device.type == "cuda" if sleep is None else sleep
        self._asleep = False
        self._discarded = False  # sleep freed the weights; the next full load restores them
        self._weight_names = set(self.model.state_dict().keys())
        tied = bool(getattr(cfg.get_text_config(), "tie_word_embeddings", False))
        self._optional_names = {"lm_head.weight"} if tied else set()
        self._weight_names -= self._optional_names
        # Each parameter once (a tied lm_head is the embedding's) with its shape,
        # for sleep()/wake_up() to free and reallocate (buffers are small and kept).
        self._params = [(p, p.shape) for p in self.model.parameters()]
        self.adapters = HFAdapters(self.model, max_lora_rank) if max_lora_rank > 0 else None
        # In-flight updates (rollout.hf_inflight): step_hook(tokens sampled so far) runs
        # between decode steps; weight_version (None: not told) tags every token sampled.
        self.step_hook: Callable[[int], None] | None = None
        self.weight_version: int | None = None
        self.kv_stale, self.cut_samples = False, 0  # weights changed inside a generate; samples cut
        self.halt = False  # set by step_hook: every row ends at this step boundary (finish "abort")
        self.cut_version: int | None = None  # set by step_hook: due rounds end (rollout.engine.due)

    # -- sampling ------------------------------------------------------------
    def generate(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig
    ) -> RolloutBatch:
        ids, offsets = self._validate(prompt_ids, prompt_offsets, n)
        parts = list(self._buckets(ids, offsets, n, sampling))
        return _assemble(ids, offsets, n, *(list(x) for x in zip(*parts)), versioned=self.weight_version is not None)

    def generate_stream(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig,
        min_groups: int = 1,
    ) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        """Yield (prompt positions, RolloutBatch of those groups) one step-limit
        bucket at a time (one bucket unless the context cuts some responses)."""
        ids, offsets = self._validate(prompt_ids, prompt_offsets, n)
        for tok, lp, length, finish, who, ver in self._buckets(ids, offsets, n, sampling):
            members = who[::n]
            sub_ids, sub_off = csr_take(ids, offsets, members)
            local = np.repeat(np.arange(members.size), n)
            yield members, _assemble(sub_ids, sub_off, n, [tok], [lp], [length], [finish], [local], [ver],
                                     versioned=self.weight_version is not None)

    def generate_rounds(self, first: RoundRequest, admit: Callable[[int], RoundRequest | None],
                        ) -> Iterator[tuple[int, np.ndarray, RolloutBatch]]:
        """Tail fill: `first`, then the rounds `admit` adds at step boundaries, in one
        chain of generates (rollout.hf_rounds.stream_rounds): (round, positions, part)."""
        from areno.rollout.hf_rounds import stream_rounds

        return stream_rounds(self, first, admit)

    def _validate(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int):
        self._check_awake()
        return validate_prompts(prompt_ids, prompt_offsets, n, max_model_len=self.max_model_len,
                                vocab_size=self.vocab_size)

    def _stops_and_seed(self, sampling: SamplingConfig) -> tuple[tuple[int, ...], int]:
        """The token ids that end a response, and the seed of one call: the
        request's, else the next draw of the engine's own stream (seeded at init)."""
        stop_ids = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else self.eos_token_ids)
        if sampling.seed is not None:
            return stop_ids, sampling.seed
        return stop_ids, int(torch.randint(0, 1 << 62, (1,), generator=self._generator))

    def _buckets(self, ids: np.ndarray, offsets: np.ndarray, n: int, sampling: SamplingConfig):
        """Per distinct step limit (one unless the context cuts some prompts'
        responses): (tokens, log-probs, lengths, finish, prompt of each response,
        version of each token: int32, -1 where the engine was not told one).
        Prompts of every length share one left-padded `generate`."""
        lengths = np.diff(offsets)
        stop_ids, seed = self._stops_and_seed(sampling)
        max_new = np.minimum(sampling.max_tokens, self.max_model_len - lengths)
        limits = np.unique(max_new)
        for limit, bucket_seed in zip(limits.tolist(), prompt_seeds(seed, limits.size).tolist()):
            members = np.flatnonzero(max_new == limit)
            rows, mask = _left_pad(ids, offsets, members, self.pad_token_id)
            tok, lp, ver = self._sample(rows, mask, n, sampling, int(limit), stop_ids, int(bucket_seed))
            length, finish = _cut_at_stop(tok, stop_ids, int(limit))
            keep = np.arange(tok.shape[1]) < length[:, None]
            ver = np.broadcast_to(ver, tok.shape)
            yield tok[keep], lp[keep], length, finish, np.repeat(members, n), ver[keep]

    def _sample(
        self, rows: np.ndarray, mask: np.ndarray, n: int, s: SamplingConfig, max_new: int,
        stop_ids: tuple[int, ...], seed: int, extra: tuple[StoppingCriteria, ...] = (), carried: int = 0,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[G, L] left-padded prompts and their [G, L] attention mask ->
        ([G*n, S] int32 tokens, [G*n, S] float32 log-probs, [S] int32 version of
        each column: weights loaded at a step boundary count from their step).
        Tail fill (hf_rounds): `carried` rows sampled once each come first; extra:
        stopping criteria after the step boundary's."""
        from transformers import GenerationConfig

        greedy = s.temperature == 0
        gc = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=not greedy,
            # [] (not None): None would be filled in from the model's generation_config.
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_token_id,
            # Neutral values for what a hub generation_config may set; areno passes the
            # warpers itself (sampling_processors) so they run before the recorder.
            repetition_penalty=1.0, min_new_tokens=0, temperature=1.0, top_k=0, top_p=1.0,
            return_dict_in_generate=True,
        )
        recorder = StepLogprobs()
        x = torch.from_numpy(rows).to(self.device)
        m = torch.from_numpy(mask).to(self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            cache, x, m = self._shared_prefix(x, m, n, carried)
            # The cache starts from the weights held now: a load before this generate needs no recompute.
            start, boundary, self.kv_stale = self.weight_version, None, False
            if self.step_hook is not None:  # the boundary needs the cache generate fills
                cache = cache if cache is not None else DynamicCache(config=self.model.config)
                boundary = StepBoundary(self, cache, m)
            criteria = [c for c in (boundary, *extra) if c is not None]
            out = self.model.generate(input_ids=x, attention_mask=m, past_key_values=cache,
                                      generation_config=gc, logits_processor=sampling_processors(s, recorder),
                                      stopping_criteria=StoppingCriteriaList(criteria) if criteria else None)
            new = out.sequences[:, x.shape[1]:]  # [G*n, S]
            lp = recorder.finish(new)
        width = new.shape[1]
        ver = boundary.column_versions(width, start) if boundary is not None else \
            np.full(width, -1 if start is None else start, dtype=np.int32)
        return new.to(torch.int32).cpu().numpy(), lp.cpu().numpy().astype(np.float32, copy=False), ver

    def _shared_prefix(self, x: torch.Tensor, mask: torch.Tensor, n: int, carried: int = 0,
                       ) -> tuple[DynamicCache | None, torch.Tensor, torch.Tensor]:
        """[C + G, L] rows and mask (C carried samples, then G prompts) -> (KV cache
        of each row but its last token, a prompt's computed once and repeated n
        times; [C + G*n, L] rows; [C + G*n, L] mask). generate() then runs only the
        last token and the new ones: the n samples of a group share their
        prompt's prefill instead of computing it n times (the same tokens and
        scores as n-fold rows, to float rounding; 30% of the demo's rollout).
        carried: tail fill's samples carried into the next generate (hf_rounds)."""
        rows = torch.cat([x[:carried], x[carried:].repeat_interleave(n, dim=0)])
        rows_mask = torch.cat([mask[:carried], mask[carried:].repeat_interleave(n, dim=0)])
        if x.shape[1] < 2:
            return None, rows, rows_mask
        cache = None
        if carried < x.shape[0]:
            cache = prefill(self.model, x[carried:, :-1], mask[carried:, :-1])
            cache.batch_repeat_interleave(n)
        if carried:
            head = prefill(self.model, x[:carried, :-1], mask[:carried, :-1])
            cache = head if cache is None else stack_rows(head, cache)
        return cache, rows, rows_mask

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        self._check_awake()
        ids = validate_sequence(ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return probe_logprobs(self.model, ids)

    # -- weights -------------------------------------------------------------
    def update_weights_inflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load weights of `version` now: between generates, or at a step boundary
        (from step_hook), where the requests held keep going: their cache is
        recomputed under the new weights before the next token (hf_inflight), and
        every token sampled from here on carries `version`."""
        self.load_weights(named_tensors)
        self.weight_version, self.kv_stale = int(version), True

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any device/dtype) into the live parameters one at a
        time (no full state dict is ever built); every expected name must come."""
        self._check_awake(loading=True)
        live = self._live_state()
        seen: set[str] = set()
        with torch.no_grad():
            for name, t in named_tensors:
                dst = live.get(name)
                if dst is None:
                    if name in self._optional_names:
                        continue
                    raise ValueError(f"weight update names {name!r}, which the engine's model does not have")
                dst.copy_(t)
                seen.add(name)
        missing = self._weight_names - seen
        if missing:
            raise WeightSyncError(f"weight update is missing {len(missing)} tensors, e.g. {min(missing)}")
        self._discarded = False

    @torch.no_grad()
    def weights_fingerprint(self) -> Fingerprint:
        """Per module group, the fp64 sum of squares of every parameter the model
        holds (see rollout.probe), under every name it has: a tied lm_head.weight
        counts as the embedding again, as the trainer sends it."""
        named = [(n.replace(".base_layer.", "."), p) for n, p in self.model.named_parameters(remove_duplicate=False)
                 if ".lora_" not in n]  # under LoRA: the base weights, as HF names them
        if "lm_head.weight" not in dict(named):
            named.append(("lm_head.weight", self.model.get_output_embeddings().weight))
        sums = torch.stack([sum_squares(t) for _, t in named]).cpu().tolist()
        return Fingerprint.of((n, s, t.numel()) for (n, t), s in zip(named, sums))

    def _live_state(self) -> dict[str, torch.Tensor]:
        """The model's state under HF names (a LoRA-wrapped layer's base_layer too)."""
        if self._lora_injected():
            return dict(base_named(self.model))
        return self.model.state_dict(keep_vars=True)

    def _lora_injected(self) -> bool:
        return self.adapters is not None and self.adapters.injected

    # -- LoRA adapter (rollout.hf_lora) ---------------------------------------
    def load_adapter(self, tensors: Mapping[str, torch.Tensor], config: Any, version: int,
                     inflight: int | None = None) -> None:
        """Copy a peft adapter (saved names, LoraConfig) into the model's LoRA
        layers (built at the first load); served from now on. inflight: weight
        version of a load at a step boundary, the rows' cache recomputed under
        the new adapter before the next token (as update_weights_inflight)."""
        self._check_awake()
        self._lora_on().load(tensors, config, version)
        if inflight is not None:
            self.weight_version, self.kv_stale = int(inflight), True

    def adapter_fingerprint(self) -> Fingerprint:
        """What the model's LoRA layers hold (rollout.lora); empty before a load."""
        self._check_awake()
        return self._lora_on().fingerprint()

    @property
    def adapter_dtype(self) -> torch.dtype:
        return self.model.dtype

    def _lora_on(self) -> HFAdapters:
        if self.adapters is None:
            raise RuntimeError("HFEngine: built without LoRA (max_lora_rank=0)")
        return self.adapters

    # -- lifecycle -----------------------------------------------------------
    def sleep(self) -> None:
        """Free the weights' memory (GPU; see `sleep` in __init__) while the
        trainer runs. They are not copied to the host and back: the weight sync
        after training overwrites every one of them, so wake_up() only
        reallocates and generating needs a full load first (as vLLM level 2).
        Serving LoRA, nothing is freed: the frozen base is never sent again."""
        if self.supports_sleep and not self._asleep and self.adapters is None:
            for p, _ in self._params:  # a new empty tensor: loaded (mmap) storages cannot shrink
                p.data = p.data.new_empty(0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._discarded = True
        self._asleep = self._asleep or self.supports_sleep

    def wake_up(self) -> None:
        """Reallocate what sleep() freed (uninitialised until the next load)."""
        if self._asleep and self._discarded:
            for p, shape in self._params:
                p.data = p.data.new_empty(shape)
        self._asleep = False

    def shutdown(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_awake(self, loading: bool = False) -> None:
        if self.model is None:
            raise RuntimeError("HFEngine: used after shutdown()")
        if self._asleep:
            raise RuntimeError("HFEngine: asleep; call wake_up() first")
        if self._discarded and not loading:
            raise RuntimeError("HFEngine: sleep() freed the weights; load a full set before sampling")


def _left_pad(ids: np.ndarray, offsets: np.ndarray, members: np.ndarray, pad: int,
              ) -> tuple[np.ndarray, np.ndarray]:
    """The `members` prompts of a CSR batch -> ([G, L] int64 left-padded with
    `pad`, [G, L] int64 attention mask), L the longest member."""
    lengths = np.diff(offsets)[members]
    width = int(lengths.max())
    col = np.arange(width)
    real = col >= (width - lengths)[:, None]  # [G, L]
    src = offsets[members][:, None] + col - (width - lengths)[:, None]
    rows = np.where(real, ids[np.where(real, src, 0)], pad).astype(np.int64)
    return rows, real.astype(np.int64)


def _cut_at_stop(tok: np.ndarray, stop_ids: tuple[int, ...], max_new: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, S] sampled tokens -> (length [B] incl. the first stop token, finish [B]).
    A row without a stop token ran to the step limit, or, when S < max_new, was
    halted (engine.halt: generate stops early otherwise only when every row has
    stopped): finish "abort"."""
    b, s = tok.shape
    hit = np.isin(tok, np.asarray(stop_ids, dtype=tok.dtype)) if stop_ids else np.zeros((b, s), bool)
    has = hit.any(axis=1)
    length = np.where(has, hit.argmax(axis=1) + 1, s).astype(np.int64)
    finish = np.where(has, FINISH_STOP, FINISH_LENGTH if s >= max_new else FINISH_ABORT).astype(np.uint8)
    return length, finish


def _assemble(
    ids: np.ndarray, offsets: np.ndarray, n: int,
    tok_parts: list, lp_parts: list, len_parts: list, fin_parts: list, who: list, ver_parts: list,
    versioned: bool = False,
) -> RolloutBatch:
    """Concatenate the per-length groups and reorder responses to prompt order
    with one CSR gather; versioned: keep each token's version (token_version)."""
    tok = np.concatenate(tok_parts).astype(np.int32, copy=False)
    lp = np.concatenate(lp_parts).astype(np.float32, copy=False)
    length = np.concatenate(len_parts)
    finish = np.concatenate(fin_parts)
    prompt_of = np.concatenate(who)
    order = np.argsort(prompt_of, kind="stable")
    src_off = offsets_from_lengths(length)
    gather, dst_off = segment_gather(src_off[:-1][order], length[order])
    return RolloutBatch(
        prompt_ids=ids,
        prompt_offsets=offsets,
        response_ids=tok[gather],
        response_offsets=dst_off,
        response_logprobs=lp[gather],
        group_index=prompt_of[order].astype(np.int64),
        finish_reason=finish[order],
        token_version=np.concatenate(ver_parts).astype(np.int32, copy=False)[gather] if versioned else None,
    )

