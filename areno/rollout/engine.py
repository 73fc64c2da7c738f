"""RolloutEngine protocol, sampling settings, input checks shared by the engines.

Engines are thin adapters (vLLM, transformers) that turn flat prompt arrays into
a RolloutBatch; they hold no RL math. This module imports neither vLLM nor
transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from areno.rollout.batch import RolloutBatch
from areno.rollout.probe import WeightSyncError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SamplingConfig",
    "RolloutEngine",
    "validate_prompts",
    "check_weight_names",
    "WeightSyncError",
]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses.

    temperature: > 0 samples from softmax(logits / temperature); 0 is greedy.
        Rollout log-probs are taken *after* temperature (and top-k/top-p), i.e.
        from the distribution actually sampled.
    top_p: nucleus mass in (0, 1]; 1 is off.
    top_k: keep the k most likely tokens; -1 or 0 is off.
    max_tokens: most response tokens per sample (>= 1); a response cut here
        finishes with reason "length".
    stop_token_ids: extra tokens that end a response (the model's eos tokens
        always do, unless ignore_eos); the stop token is kept in the response.
    seed: None draws from the engine's generator; an int makes the rollout
        reproducible (each prompt gets its own stream derived from it).
    ignore_eos: keep sampling past eos up to max_tokens (benchmarks).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a sampler."""

    supports_sleep: bool
    max_model_len: int

    def generate(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig
    ) -> RolloutBatch:
        """P prompts (CSR: prompt_ids int32, prompt_offsets [P+1] int64) -> n
        samples each. Responses are ordered by prompt, group_index[i] = i // n."""
        ...

    def generate_stream(
        self, prompt_ids: np.ndarray, prompt_offsets: np.ndarray, n: int, sampling: SamplingConfig,
        min_groups: int = 1,
    ) -> Iterator[tuple[np.ndarray, RolloutBatch]]:
        """Like generate, but yields (prompt positions [p] int64, RolloutBatch of
        those p groups) as groups finish, so they can be scored meanwhile."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load a full set of HF-named weights, one tensor at a time (the caller
        checks the result: fleet/weight_sync.py)."""
        ...

    def prompt_logprobs(self, ids: np.ndarray) -> np.ndarray:
        """[L] ids -> [L-1] float32 log p(ids[i+1] | ids[:i+1]) at temperature 1."""
        ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


def validate_prompts(
    prompt_ids: Any, prompt_offsets: Any, n: int, *, max_model_len: int, vocab_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Check a generate() call's inputs; return (int32 ids, int64 offsets).

    ValueError, naming the prompt, for: n < 1, malformed offsets, an empty
    prompt, a prompt that leaves no room for one response token
    (length >= max_model_len), a token id outside [0, vocab_size).
    """
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {n!r}")
    ids = np.asarray(prompt_ids)
    offsets = np.asarray(prompt_offsets)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"prompt_ids: expected a 1-D integer array, got {ids.dtype} {ids.shape}")
    if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError("prompt_offsets: expected a 1-D integer array [P+1]")
    if offsets.size == 1:
        raise ValueError("no prompts: prompt_offsets has a single entry")
    if offsets[0] != 0 or offsets[-1] != ids.size:
        raise ValueError(
            f"prompt_offsets: must run from 0 to len(prompt_ids)={ids.size}, "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    lengths = np.diff(offsets)
    if np.any(lengths < 0):
        raise ValueError(f"prompt_offsets: not monotone at prompt {int(np.flatnonzero(lengths < 0)[0])}")
    if np.any(lengths == 0):
        raise ValueError(f"prompt {int(np.flatnonzero(lengths == 0)[0])} is empty (0 tokens)")
    too_long = lengths >= max_model_len
    if np.any(too_long):
        p = int(np.flatnonzero(too_long)[0])
        raise ValueError(
            f"prompt {p} has {int(lengths[p])} tokens; the engine's max_model_len is "
            f"{max_model_len} and a prompt must leave room for at least one response token"
        )
    if vocab_size is not None and ids.size:
        bad = (ids < 0) | (ids >= vocab_size)
        if np.any(bad):
            t = int(np.flatnonzero(bad)[0])
            p = int(np.searchsorted(offsets, t, side="right") - 1)
            raise ValueError(f"prompt {p} has token id {int(ids[t])}, outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32, copy=False), offsets.astype(np.int64, copy=False)


def validate_sequence(ids: Any, *, max_model_len: int, vocab_size: int | None) -> np.ndarray:
    """Check a prompt_logprobs() input: 1-D, at least 2 tokens, fits the engine."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size < 2:
        raise ValueError(f"prompt_logprobs: need at least 2 tokens, got shape {ids.shape}")
    validate_prompts(ids, np.array([0, ids.size]), 1, max_model_len=max_model_len,
                     vocab_size=vocab_size)
    return ids


def check_weight_names(names: Iterable[str], expected: set[str], optional: set[str] = frozenset()) -> None:
    """Strict name check for a weight push, before anything is loaded.

    Unknown names -> ValueError (a renamed or foreign tensor would otherwise be
    dropped or half-loaded). Missing names -> WeightSyncError: the engine would
    serve a mix of old and new weights. `optional` names may be absent or
    present (e.g. lm_head.weight of a tied model).
    """
    got = set(names)
    unknown = got - expected - optional
    if unknown:
        raise ValueError(
            f"weight update has {len(unknown)} tensor name(s) the engine's model does not have: "
            f"{_few(unknown)}"
        )
    missing = expected - got
    if missing:
        raise WeightSyncError(
            f"weight update is missing {len(missing)} of {len(expected)} tensors: {_few(missing)}; "
            "send the full set (the engine would serve a mix of old and new weights)"
        )


def _few(names: set[str], k: int = 5) -> str:
    s = sorted(names)
    return ", ".join(s[:k]) + (f", ... (+{len(s) - k})" if len(s) > k else "")


def engine_sampling(sampling: SamplingConfig, g: int, num_engines: int) -> SamplingConfig:
    """The sampling engine g of `num_engines` gets for its share of a call: its own
    stream, prompt_seeds(seed, E)[g] (unseeded stays unseeded). The controller's
    split (PeerEngines) and an engine process's episode driver both use it, so one
    engine samples the same either way."""
    if sampling.seed is None:
        return sampling
    return replace(sampling, seed=int(prompt_seeds(sampling.seed, num_engines)[g]))


def prompt_seeds(seed: int, num_prompts: int) -> np.ndarray:
    """[P] independent 63-bit seeds derived from (seed, prompt index), so no two
    prompts (nor two steps seeded step and step+1) share a random stream."""
    ss = np.random.SeedSequence(seed)
    return (ss.generate_state(num_prompts, dtype=np.uint64) >> np.uint64(1)).astype(np.int64)


@dataclass(frozen=True)
class RoundRequest:
    """One round of a tail-filled generation loop (fleet/tail_fill.py): its prompts
    (CSR: int32 ids, int64 offsets [P+1]), samples per prompt and sampling;
    version: the weights the scheduler admitted it with (its deadline's: a
    --cut-at-deadline cut ends it once the engine's cut_version reaches it)."""

    ids: np.ndarray
    offsets: np.ndarray
    n: int
    sampling: SamplingConfig
    version: int | None = None


def due(version: int | None, cut_version: int | None) -> bool:
    """Whether a round admitted with weights `version` is due under
    --cut-at-deadline: the trainer now holds version + K updates (the engine's
    cut_version is that minus K, None: no cut), so its samples still generating
    end at this step boundary, finish "length"."""
    return cut_version is not None and version is not None and version <= cut_version
