"""Which prompts each step trains on: a deterministic, resumable shuffle.

The per-step call (`PromptSampler.next_batch`) slices a permutation made once
per epoch; its state is a few ints, saved in checkpoints.
"""

from __future__ import annotations

import numpy as np

from areno.errors import UserError


class PromptSampler:
    """Deterministic shuffled batches of prompt indices, epoch after epoch.

    Epoch e visits the prompts in the order `default_rng([seed, e]).permutation(P)`
    in batches of `batch_size` prompts. A batch never spans two epochs: the last
    P % batch_size prompts of each epoch's order are dropped (they are in other
    positions, and so used, in other epochs). This keeps a prompt from
    appearing twice in one batch. `state_dict()` / `load_state_dict()` resume
    the exact same order.
    """

    def __init__(self, num_prompts: int, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise UserError(f"prompt batch size must be >= 1, got {batch_size}")
        if batch_size > num_prompts:
            raise UserError(
                f"prompt batch size {batch_size} is larger than the dataset's {num_prompts} "
                "usable prompts; lower the batch size or use more data"
            )
        self.num_prompts = int(num_prompts)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next batch's first prompt
        self._order: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.num_prompts).astype(np.int64)
        return self._order

    def next_batch(self) -> np.ndarray:
        """[batch_size] int64 prompt indices."""
        if self.position + self.batch_size > self.num_prompts:
            self.epoch += 1
            self.position = 0
            self._order = None
        out = self._epoch_order()[self.position : self.position + self.batch_size].copy()
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off (its seed wins; the batch size may change)."""
        if int(state["num_prompts"]) != self.num_prompts:
            raise UserError(
                f"resume: the dataset now has {self.num_prompts} usable prompts but the "
                f"checkpoint was sampling from {state['num_prompts']}; resume with the same data"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


def batches_drawn(state: dict) -> int:
    """How many batches the sampler drew before `state` (a state_dict), over all
    epochs: distinct for every batch, and step - 1 when each step draws one."""
    per_epoch = int(state["num_prompts"]) // int(state["batch_size"])
    return int(state["epoch"]) * per_epoch + int(state["position"]) // int(state["batch_size"])
