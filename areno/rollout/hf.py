"""transformers rollout engine: the fallback where vLLM is absent, and a second
opinion in tests. Same contract as VLLMEngine.

Prompts of equal length are sampled together (no padding, so positions and
log-probs are exactly those of an unpadded forward); groups run one after the
other. Log-probs are the log-softmax of the processed scores (after
temperature / top-k / top-p), i.e. of the distribution actually sampled.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from areno.rollout.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch, csr_take, offsets_from_lengths
from areno.rollout.engine import (
    SamplingConfig,
    check_weight_names,
    named_tensor_dict,
    prompt_seeds,
    validate_prompts,
    validate_sequence,
)
from areno.rollout.probe import Fingerprint, Probe, WeightSyncError, probe_logprobs, sum_squares, verify_probe

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """RolloutEngine over `AutoModelForCausalLM.generate`.

    model: HF directory or hub id. dtype: "auto" (the checkpoint's), "float32",
    "bfloat16", "float16". device: None picks cuda if available. max_model_len:
    prompt + response limit (None: config.max_position_embeddings).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
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
        self.supports_sleep: bool = self.device.type == "cuda"
        self._asleep = False
        self._weight_names = set(self.model.state_dict().keys())
        tied = bool(getattr(cfg.get_text_config(), "tie_word_embeddings", False))
        self._optional_names = {"lm_head.weight"} if tied else set()
        self._weight_names -= self._optional_names

    # -- sampling ------------------------------------------------------------
    def generate(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig
    ) -> RolloutBatch:
        ids, offsets = self._validate(prompt_ids, prompt_offsets, n)
        parts = list(self._buckets(ids, offsets, n, sampling))
        return _assemble(ids, offsets, n, *(list(x) for x in zip(*parts)))

    def generate_stream(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig,
        min_groups: int = 1,
    ) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        """Yield (prompt positions, RolloutBatch of those groups) one prompt-length
        bucket at a time (transformers generates each bucket in one call)."""
        ids, offsets = self._validate(prompt_ids, prompt_offsets, n)
        for tok, lp, length, finish, who in self._buckets(ids, offsets, n, sampling):
            members = who[::n]
            sub_ids, sub_off = csr_take(ids, offsets, members)
            local = np.repeat(np.arange(members.size), n)
            yield members, _assemble(sub_ids, sub_off, n, [tok], [lp], [length], [finish], [local])

    def _validate(self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int):
        self._check_awake()
        return validate_prompts(
            prompt_ids, prompt_offsets, n, max_model_len=self.max_model_len, vocab_size=self.vocab_size
        )

    def _buckets(self, ids: np.ndarray, offsets: np.ndarray, n: int, sampling: SamplingConfig):
        """Per distinct prompt length: (tokens, log-probs, lengths, finish, prompt of each response)."""
        lengths = np.diff(offsets)
        stop_ids = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else self.eos_token_ids)
        if sampling.seed is None:  # next draw of the engine's own stream (seeded at init)
            seed = int(torch.randint(0, 1 << 62, (1,), generator=self._generator))
        else:
            seed = sampling.seed
        group_seeds = prompt_seeds(seed, int(lengths.max()) + 1)
        for plen in np.unique(lengths):  # O(distinct prompt lengths)
            members = np.flatnonzero(lengths == plen)
            rows = ids[offsets[members][:, None] + np.arange(plen)]  # [G, plen], no padding
            max_new = min(sampling.max_tokens, self.max_model_len - int(plen))
            tok, lp = self._sample(rows, n, sampling, max_new, stop_ids, int(group_seeds[plen]))
            length, finish = _cut_at_stop(tok, stop_ids, max_new)
            keep = np.arange(tok.shape[1]) < length[:, None]
            yield tok[keep], lp[keep], length, finish, np.repeat(members, n)

    def _sample(
        self, rows: np.ndarray, n: int, s: SamplingConfig, max_new: int, stop_ids: tuple[int, ...], seed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """[G, L] prompts -> ([G*n, S] int32 tokens, [G*n, S] float32 log-probs)."""
        from transformers import GenerationConfig

        greedy = s.temperature == 0
        gc = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=not greedy,
            # [] (not None): None would be filled in from the model's generation_config.
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_token_id,
            repetition_penalty=1.0,  # neutral values for what a hub generation_config may set
            min_new_tokens=0,
            output_scores=True,
            return_dict_in_generate=True,
            **({} if greedy else dict(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0))),
        )
        x = torch.from_numpy(rows.astype(np.int64)).to(self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            cache, x = self._shared_prefix(x, n)
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), past_key_values=cache,
                                      generation_config=gc)
        new = out.sequences[:, x.shape[1]:]  # [G*n, S]
        # scores[t]: processed logits of step t -> log-softmax in fp32 -> sampled token.
        scores = torch.stack(out.scores, dim=1).float()  # [G*n, S, V]
        lp = torch.log_softmax(scores, dim=-1).gather(-1, new[..., None])[..., 0]
        return new.to(torch.int32).cpu().numpy(), lp.cpu().numpy().astype(np.float32, copy=False)

    def _shared_prefix(self, x: torch.Tensor, n: int) -> tuple[DynamicCache | None, torch.Tensor]:
        """[G, L] prompts -> (KV cache of each prompt but its last token, computed
        once and repeated n times; [G*n, L] rows). generate() then runs only the
        last prompt token and the new ones: the n samples of a group share their
        prompt's prefill instead of computing it n times (the same tokens and
        scores as n-fold rows, to float rounding; 30% of the demo's rollout)."""
        rows = x.repeat_interleave(n, dim=0)
        if x.shape[1] < 2:
            return None, rows
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=x[:, :-1], past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(n)
        return cache, rows

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        self._check_awake()
        ids = validate_sequence(ids, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return probe_logprobs(self.model, ids)

    # -- weights -------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], probe: Probe | None = None) -> None:
        """Strict by name (unknown -> ValueError, missing -> WeightSyncError),
        copied into the existing parameters, then the probe is checked."""
        self._check_awake()
        weights = named_tensor_dict(named_tensors)
        check_weight_names(weights, self._weight_names, self._optional_names)
        self._push(weights)
        if probe is not None:
            verify_probe(self, probe)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any device/dtype) into the live parameters one at a
        time (no full state dict is ever built); every expected name must come."""
        self._check_awake()
        live = self.model.state_dict(keep_vars=True)
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

    @torch.no_grad()
    def weights_fingerprint(self) -> Fingerprint:
        """Per module group, the fp64 sum of squares of every parameter the model
        holds (see rollout.probe), under every name it has: a tied lm_head.weight
        counts as the embedding again, as the trainer sends it."""
        named = list(self.model.named_parameters(remove_duplicate=False))
        if "lm_head.weight" not in dict(named):
            named.append(("lm_head.weight", self.model.get_output_embeddings().weight))
        sums = torch.stack([sum_squares(t) for _, t in named]).cpu().tolist()
        return Fingerprint.of((n, s, t.numel()) for (n, t), s in zip(named, sums))

    def _push(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=False)

    # -- lifecycle -----------------------------------------------------------
    def sleep(self) -> None:
        """Move the model to host memory (GPU); a no-op on CPU."""
        if self.supports_sleep and not self._asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.model.to(self.device)
        self._asleep = False

    def shutdown(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_awake(self) -> None:
        if self.model is None:
            raise RuntimeError("HFEngine: used after shutdown()")
        if self._asleep:
            raise RuntimeError("HFEngine: asleep; call wake_up() first")


def _cut_at_stop(tok: np.ndarray, stop_ids: tuple[int, ...], max_new: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, S] sampled tokens -> (length [B] incl. the first stop token, finish [B]).
    Rows without a stop token ran to the step limit (generate stops early only
    when every row has stopped)."""
    b, s = tok.shape
    hit = np.isin(tok, np.asarray(stop_ids, dtype=tok.dtype)) if stop_ids else np.zeros((b, s), bool)
    has = hit.any(axis=1)
    length = np.where(has, hit.argmax(axis=1) + 1, s).astype(np.int64)
    finish = np.where(has, FINISH_STOP, FINISH_LENGTH).astype(np.uint8)
    return length, finish


def _assemble(
    ids: np.ndarray, offsets: np.ndarray, n: int,
    tok_parts: list, lp_parts: list, len_parts: list, fin_parts: list, who: list,
) -> RolloutBatch:
    """Concatenate the per-length groups and reorder responses to prompt order
    with one CSR gather."""
    tok = np.concatenate(tok_parts).astype(np.int32, copy=False)
    lp = np.concatenate(lp_parts).astype(np.float32, copy=False)
    length = np.concatenate(len_parts)
    finish = np.concatenate(fin_parts)
    prompt_of = np.concatenate(who)
    order = np.argsort(prompt_of, kind="stable")
    src_off = offsets_from_lengths(length)
    new_len = length[order]
    dst_off = offsets_from_lengths(new_len)
    gather = np.repeat(src_off[:-1][order] - dst_off[:-1], new_len) + np.arange(dst_off[-1])
    return RolloutBatch(
        prompt_ids=ids,
        prompt_offsets=offsets,
        response_ids=tok[gather],
        response_offsets=dst_off,
        response_logprobs=lp[gather],
        group_index=prompt_of[order].astype(np.int64),
        finish_reason=finish[order],
    )

