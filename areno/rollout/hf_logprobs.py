"""The sampled tokens' log-probs inside transformers' `generate`, one step at a
time, so no [rows, steps, vocab] tensor ever exists (issue 17, 2d).

`output_scores=True` kept every step's processed scores ([rows, vocab] fp32
each) until generate returned, then stacked them and took a log-softmax: about
3 x rows x steps x vocab x 4 bytes (240 GB at --max-new-tokens 1024 on an H200).
`StepLogprobs` is the last logits processor instead: at step t it keeps the
log-softmax of step t's scores ([rows, vocab], one step only) and gathers step
t-1's at the token sampled from it, which generate has appended to input_ids by
then. The last step is gathered after generate returns (`finish`).

transformers appends its own warpers (temperature, top-k, top-p) AFTER the
caller's processors, so areno passes them itself, in transformers' order, and
leaves the generation config neutral: the recorder then sees exactly the
scores that are sampled from.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from areno.rollout.engine import SamplingConfig


class StepLogprobs(LogitsProcessor):
    """Records log p(sampled token) of every step; returns the scores unchanged."""

    def __init__(self) -> None:
        self._last: torch.Tensor | None = None   # [B, V] fp32 log-softmax of the latest step
        self._taken: list[torch.Tensor] = []     # [B] fp32 per finished step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:  # input_ids[:, -1] was sampled from the previous step's scores
            self._taken.append(self._last.gather(-1, input_ids[:, -1:])[:, 0])
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, S] tokens generate returned -> [B, S] fp32 log-probs. generate may
        have run steps past S and undone them (deferred stop checks): those
        recorded steps are dropped."""
        steps = new_tokens.shape[1]
        if len(self._taken) < steps and self._last is not None:
            self._taken.append(self._last.gather(-1, new_tokens[:, len(self._taken), None])[:, 0])
        self._last = None
        if not steps:
            return torch.zeros(new_tokens.shape, dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self._taken[:steps], dim=1)


def sampling_processors(s: SamplingConfig, recorder: StepLogprobs) -> LogitsProcessorList:
    """transformers' own warpers for `s`, in the order generate would add them
    (temperature, top-k, top-p; min_tokens_to_keep=1), then the recorder.
    Greedy (temperature 0) samples the raw logits: the recorder alone."""
    procs: list[LogitsProcessor] = []
    if s.temperature > 0:
        if s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k > 0:
            procs.append(TopKLogitsWarper(top_k=s.top_k))
        if s.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=s.top_p))
    return LogitsProcessorList([*procs, recorder])
