"""Choice lists of TrainConfig whose owners are slow to import (torch, numpy, the
reward workers): declared here so that config.py, which the CLI imports to
validate before anything heavy, can name them without importing their owners.

Each list is declared once, as a `Literal`; its owner imports it from here and
derives its check with `typing.get_args`, as TrainConfig's flags and checks do:

    AdvantageMode  group advantages (advantages.py)
    DynamicSampling  which groups dynamic sampling keeps (dynsample.py)
    Algo, KLType   the policy loss (losses.py)
    ISLevel, ISMode  its behaviour importance weight (losses.behaviour_weights)
    LossAgg        how the loss is aggregated (split.aggregation_weights)
    OnError        a reward that fails (rewards/pool.py)
    Device, DType, Strategy   the torch backend (backend/config.py)

A list whose owner is light stays with it: `rollout.factory.EngineKind`.
"""

from __future__ import annotations

from typing import Literal

AdvantageMode = Literal["grpo", "drgrpo", "rloo"]
DynamicSampling = Literal["off", "reward", "accuracy"]  # --dynamic-sampling
Algo = Literal["grpo", "gspo"]
KLType = Literal["k1", "k3"]
ISLevel = Literal["token", "sequence", "geometric"]  # --is-level
ISMode = Literal["truncate", "mask"]                 # --is-mode
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# The default --loss-agg of each --algo: GSPO's objective is a mean over
# sequences of per-sequence token means (arXiv:2507.18071, eq. 5; verl always
# aggregates GSPO this way); GRPO keeps the token mean.
LOSS_AGG_BY_ALGO: dict[Algo, LossAgg] = {"grpo": "token-mean", "gspo": "seq-mean-token-mean"}

OnError = Literal["fail", "zero", "skip"]  # --on-reward-error

# In the order --help and the config's errors list them after "auto".
Device = Literal["cuda", "cpu"]
DType = Literal["bfloat16", "float32"]
Strategy = Literal["auto", "fsdp2", "ddp"]
