"""TrainConfig: the one place an `areno train` knob is declared.

Each field carries its CLI group (the --help panel), its help text (unit,
allowed values, what the default means) and its bounds. The CLI builds its
flags from these fields and YAML (`--config run.yaml`) fills the same fields;
flags override YAML. `TrainConfig.from_sources` validates everything before
any heavy import or process start, raising `UserError` (one line, naming the
flag) for a mistake: each value against its type and bounds (fieldcheck.py),
then the rules between options (rules.py).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from areno.choices import (
    LOSS_AGG_BY_ALGO, AdvantageMode, Algo, Device, DType, DynamicSampling, ISLevel, ISMode, KLType, LossAgg, OnError,
    Strategy,
)
from areno.config.fieldcheck import base_type, check_value
from areno.config.lora import FULL_FT_LR, LORA_LR_FACTOR
from areno.config.offpolicy import OFF_POLICY_TIS_CAP, off_policy_defaults, turned_on_line
from areno.config.rules import check_reward_timeout, check_rules, fill_demo_preset
from areno.config.env import EnvOptions
from areno.rollout.factory import EngineKind

GROUPS = (
    "Model", "Data", "Rollout", "Rewards", "Algorithm", "Optimization", "LoRA", "Parallelism",
    "Logging and checkpoints",
)

STOP_WINDOW = 20  # steps whose mean reward --stop-at-reward compares


def opt(default: Any, help: str, group: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, shown: str | None = None,
        off_flag: str | None = None) -> Any:
    """A TrainConfig field. shown: how --help states a default that is not a plain value (None
    meaning "derived from other options"); off_flag: what turns off a switch derived on."""
    assert group in GROUPS, group
    return field(default=default, metadata=dict(help=help, group=group, ge=ge, gt=gt, le=le, lt=lt,
                                                 shown=shown, off_flag=off_flag))


@dataclass
class TrainConfig(EnvOptions):  # --env-path and its options: config/env.py
    # -- Model ---------------------------------------------------------------
    ckpt: str | None = opt(
        None, "HF model directory or hub id to train. Unset: the embedded demo "
        "(a tiny model built locally, trained on one-digit addition).", "Model",
        shown="unset (the demo)")
    dtype: Literal["auto", DType] = opt(
        "auto", "Parameter dtype. auto: bfloat16 on GPU, float32 on CPU.", "Model")
    # -- Data ------------------------------------------------------------------
    dataset_path: str | None = opt(
        None, "gsm8k:main, a hub id name[:config[:split]], a local .jsonl, .json, .parquet "
        "or .csv file, or a save_to_disk directory. Unset: the embedded demo task.", "Data",
        shown="unset (the demo task)")
    dataset_split: str = opt("train", "Split to train on (a split in --dataset-path wins).", "Data")
    dataset_loader_fn: str | None = opt(
        None, "file.py[:fn] mapping a raw row to {prompt, answer, ...} (fn defaults to load_row).",
        "Data", shown="unset")
    chat_template: bool = opt(True, "Render prompts with the tokenizer's chat template "
                              "(--no-chat-template: plain text).", "Data")
    system_prompt: str | None = opt(None, "System message prepended to every chat prompt.", "Data",
                                    shown="none")
    max_prompt_len: int = opt(512, "Prompts longer than this many tokens are dropped (counted).",
                              "Data", ge=1)
    batch_size: int = opt(16, "Prompts per step.", "Data", ge=1)
    skip_bad_rows: bool = opt(False, "Skip (and count) malformed dataset rows and unparsable JSON "
                              "lines instead of failing.", "Data")
    # -- Rollout ---------------------------------------------------------------
    rollout_engine: EngineKind | None = opt(
        None, "vllm or hf (transformers generate). Given, it must run: --rollout-engine vllm "
        "where vLLM does not import is an error. Unset: vllm, or hf where vLLM does not import "
        "(the start-up line says so).", "Rollout", shown="vllm (hf where vLLM does not import)")
    temperature: float = opt(1.0, "Sampling temperature; log-probs are taken after it.",
                             "Rollout", gt=0.0)
    top_p: float = opt(1.0, "Nucleus sampling mass (1 = off).", "Rollout", gt=0.0, le=1.0)
    top_k: int = opt(-1, "Top-k sampling (-1 = off).", "Rollout", ge=-1)
    n_samples: int = opt(8, "Completions per prompt (the GRPO group size).", "Rollout", ge=1)
    max_new_tokens: int = opt(1024, "Maximum tokens generated per completion.", "Rollout", ge=1)
    tensor_parallel_size: int = opt(1, "vLLM tensor-parallel size (the transformers engine has "
                                    "none: > 1 needs vLLM).", "Rollout", ge=1)
    gpu_memory_utilization: float | None = opt(
        None, "Fraction of its GPU's memory vLLM may take.", "Rollout", gt=0.0, le=1.0,
        shown="0.5 colocated with training, 0.9 in an engine process of its own (--rollout-world-size)")
    kv_cache_gb: float = opt(0.5, "KV-cache size for vLLM on CPU, in GiB.", "Rollout", gt=0.0)
    off_policy_steps: int = opt(
        0, "Asynchronous rollouts, the staleness bound K: with K >= 1 the engines sample up to "
        "K batches ahead while the ranks train, each with weights at most K versions behind the "
        "policy it updates (K + 1 copies of the weights in shared memory); the loss is decoupled "
        f"PPO (turns on --recompute-logprobs, and --tis-cap {OFF_POLICY_TIS_CAP:g} unless "
        "given). Needs --rollout-world-size. 0: synchronous, every batch sampled by the "
        "current policy.",
        "Rollout", ge=0)
    # -- Rewards -------------------------------------------------------------
    reward_fn_path: str | None = opt(
        None, "Reward plugin: a .py file defining reward_fn(record) -> float or "
        "reward_fn_batch(list) -> list[float] (async allowed). Required with --dataset-path.",
        "Rewards", shown="unset")
    reward_workers: int = opt(2, "Reward worker processes (0 = in-process, no timeout kill).",
                              "Rewards", ge=0)
    reward_timeout: float = opt(10.0, "Seconds a reward call may take before its worker is killed.",
                                "Rewards", gt=0.0)
    overlap_rewards: bool = opt(
        True, "Decode and score each group as soon as it finishes generating, while the rest "
        "still generate. Off: score after the whole rollout.", "Rewards")
    on_reward_error: OnError = opt(
        "fail", "A reward that raises, times out or is NaN: fail the run, score it 0, or skip "
        "the sample. Every case is counted in the metrics.", "Rewards")
    # -- Algorithm -----------------------------------------------------------
    algo: Algo = opt(
        "grpo", "grpo: per-token clipped ratio; gspo: clipped length-normalised sequence ratio "
        "(arXiv:2507.18071).", "Algorithm")
    adv_mode: AdvantageMode = opt(
        "grpo", "Group advantage: grpo (r-mean)/std, drgrpo r-mean, rloo leave-one-out.",
        "Algorithm")
    loss_agg: LossAgg | None = opt(
        None, "Loss aggregation. Default follows --algo: token-mean for grpo, "
        "seq-mean-token-mean for gspo (the GSPO paper's per-sequence objective, as verl). "
        "seq-mean-token-sum-norm is Dr. GRPO's (normalised by --max-new-tokens; under --env-path "
        "by a trajectory's sampled-token room, min(--max-turns x --max-new-tokens, its budget)).",
        "Algorithm",
        shown="token-mean (grpo), seq-mean-token-mean (gspo)")
    clip_eps_low: float | None = opt(
        None, "Lower clip epsilon.", "Algorithm", ge=0.0, lt=1.0, shown="0.2 (grpo), 3e-4 (gspo)")
    clip_eps_high: float | None = opt(
        None, "Upper clip epsilon (> low is DAPO's clip-higher).", "Algorithm", ge=0.0,
        shown="0.2 (grpo), 4e-4 (gspo)")
    clip_ratio_c: float | None = opt(
        None, "Dual-clip constant C > 1 (Ye et al. 2020; verl's clip_ratio_c): for tokens with "
        "advantage A < 0 the policy loss is capped at -C*A, so a huge ratio on a bad token "
        "cannot blow up the update.", "Algorithm", gt=1.0, shown="off")
    kl_coef: float = opt(0.0, "KL-to-reference coefficient (0 = off, no reference model loaded).",
                         "Algorithm", ge=0.0)
    kl_type: KLType = opt("k3", "KL estimator (Schulman): k1 or k3.", "Algorithm")
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient (0 = off).", "Algorithm", ge=0.0)
    tis_cap: float | None = opt(
        None, "Truncated importance-sampling cap C: each token's policy loss is weighted by "
        "min(trainer/sampler probability ratio, C) (takes the trainer's old log-probs, "
        "--recompute-logprobs).", "Algorithm",
        gt=0.0, shown=f"off in fp32; {OFF_POLICY_TIS_CAP:g} in bf16/fp16 or with --off-policy-steps >= 1")
    is_level: ISLevel = opt(
        "token", "Level of the --tis-cap importance weight: token (each token's own ratio), "
        "sequence (the product over the completion: unbiased, high variance; verl's "
        "sequence-level IS) or geometric (exp of the mean token log-ratio, GSPO-style).",
        "Algorithm")
    is_mode: ISMode = opt(
        "truncate", "What a weight outside the band gets: truncate caps it at --tis-cap (TIS); "
        "mask drops the token (or, at --is-level sequence/geometric, the whole completion) from "
        "the loss when its weight is over --tis-cap or under --is-mask-low (AReaL's and verl's "
        "rejection); the rest keep their weight.", "Algorithm")
    is_mask_low: float = opt(
        0.0, "Lower edge of the --is-mode mask band (0: none, as AReaL; verl's default is "
        "1 / --tis-cap).", "Algorithm", ge=0.0)
    filter_zero_variance_groups: bool = opt(
        False, "Drop groups whose rewards are all equal from the update.", "Algorithm")
    dynamic_sampling: DynamicSampling = opt(
        "off", "DAPO's dynamic sampling: generate rounds of --batch-size prompts until "
        "--batch-size informative groups are kept; reward: rewards not all equal, accuracy: some "
        "but not all correct (reward >= 1). The last round's surplus is dropped; under "
        "--partial-rollouts a step takes only the groups it still lacks, first finished. off: "
        "every group of one rollout trains.", "Algorithm")
    max_sampling_rounds: int = opt(
        4, "Rounds a --dynamic-sampling step may generate (--partial-rollouts: rounds' worth of "
        "groups it may take); at the bound it trains on the groups "
        "it kept (sampling/bound_hit).", "Algorithm", ge=1)
    mask_overlong: bool = opt(
        False, "Drop completions cut by --max-new-tokens from the update; under --env-path, "
        "trajectories whose last turn was cut at its token cap (--max-new-tokens or the trajectory "
        "budget), not those --max-turns or the budget ended after a turn that stopped.", "Algorithm")
    overlong_buffer: int = opt(
        0, "DAPO's soft overlong punishment: a completion longer than --max-new-tokens minus this "
        "many tokens loses reward linearly, down to -(--overlong-penalty) at --max-new-tokens; "
        "added to the reward before advantages (0 = off).", "Algorithm", ge=0)
    overlong_penalty: float = opt(1.0, "The largest overlong punishment (DAPO's penalty factor).",
                                  "Algorithm", ge=0.0)
    # -- Optimization ----------------------------------------------------------
    lr: float | None = opt(
        None, "Peak AdamW learning rate. Unset: 1e-6, or 10x that (1e-5) with --lora-rank > 0 "
        "(LoRA wants a ~10x higher LR than full fine-tuning: Schulman et al., \"LoRA without "
        "regret\", 2025).", "Optimization", gt=0.0, shown="1e-6; 1e-5 with --lora-rank > 0")
    weight_decay: float = opt(0.0, "AdamW weight decay.", "Optimization", ge=0.0)
    warmup_steps: int = opt(0, "Linear warmup optimizer steps before cosine decay.",
                            "Optimization", ge=0)
    min_lr_ratio: float = opt(0.1, "Final LR as a fraction of --lr (cosine floor).",
                              "Optimization", ge=0.0, le=1.0)
    max_grad_norm: float = opt(1.0, "Gradient-norm clip (0 = off).", "Optimization", ge=0.0)
    mini_batches: int = opt(1, "Optimizer steps per rollout batch (mini-batches).",
                            "Optimization", ge=1)
    ppo_epochs: int = opt(1, "Passes over each rollout batch.", "Optimization", ge=1)
    recompute_logprobs: bool | None = opt(
        None, "Take the PPO ratio's old log-probs from the trainer (its own, detached, when a "
        "step makes one update; recomputed before the first update otherwise) instead of the "
        "sampler's, whose kernels differ in bf16 (docs/PERFORMANCE.md: at K = 0 they clip "
        "tokens before any update); unset, the sampler's mismatch is then a truncated-IS "
        f"weight (--tis-cap {OFF_POLICY_TIS_CAP:g}); recompute_logprobs: false in --config takes the "
        "sampler's.", "Optimization",
        shown="auto: on in bf16/fp16 or with --off-policy-steps >= 1, off in fp32")
    grad_checkpointing: bool = opt(False, "Activation checkpointing.", "Optimization")
    max_tokens_per_micro: int | None = opt(
        None, "Token budget of one micro-batch per rank, measured per device "
        "(docs/PERFORMANCE.md).", "Optimization", ge=1, shown="16384 on GPU, 4096 on CPU")
    max_nan_steps: int = opt(3, "Stop after this many NaN/inf steps in a row (each is skipped).",
                             "Optimization", ge=1)
    rank_heartbeat_timeout: float = opt(
        0.0, "Seconds a training rank may go without a heartbeat (stopped, frozen) before the run "
        "stops naming it; 0 = max(30, 3 x the longest gap between its heartbeats so far).",
        "Optimization", ge=0.0)
    # A cold GPU start compiles vLLM and captures CUDA graphs in every rank, and
    # rank 0 alone writes a checkpoint while the others wait in a collective.
    startup_timeout: float = opt(
        1800.0, "Seconds every rank gets to load the model, build its engine and report ready.",
        "Optimization", gt=0.0)
    command_timeout: float = opt(
        3600.0, "Seconds one command to the ranks (a training step, a rollout, a save) may take.",
        "Optimization", gt=0.0)
    collective_timeout: float = opt(
        1800.0, "Seconds a collective may wait for every rank (torch.distributed's timeout: "
        "a rank saving a checkpoint keeps the others waiting this long at most).",
        "Optimization", gt=0.0)
    # -- LoRA --------------------------------------------------------------------
    lora_rank: int = opt(
        0, "Train LoRA adapters of this rank on the frozen model instead of all its weights "
        "(0 = full fine-tuning). Checkpoints then hold the adapter (peft format), not the model.",
        "LoRA", ge=0)
    lora_alpha: float | None = opt(
        None, "LoRA scaling numerator: the update is (alpha / rank) * B @ A.", "LoRA", gt=0.0,
        shown="2 x --lora-rank")
    lora_dropout: float = opt(0.0, "Dropout on the adapters' input during the update.", "LoRA",
                              ge=0.0, lt=1.0)
    lora_target_modules: str = opt(
        "all-linear", "Comma-separated names of the decoder layers' linears to adapt (q_proj,v_proj), "
        "or all-linear: every linear of attention and MLP; add lm_head (all-linear,lm_head) to adapt an "
        "untied lm_head too (the demo's LoRA default). Never the embeddings.",
        "LoRA")
    save_merged: bool = opt(
        False, "With --lora-rank: checkpoints also hold the merged full model (HF format) in "
        "<step dir>/merged/.", "LoRA")
    # -- Parallelism -------------------------------------------------------------
    device: Literal["auto", Device] = opt("auto", "Training device (auto: cuda if present).",
                                          "Parallelism")
    world_size: int | None = opt(None, "Training ranks.", "Parallelism", ge=1,
                                 shown="number of GPUs less --rollout-world-size, 1 on CPU")
    rollout_world_size: int = opt(
        0, "Processes that only run rollout engines, beside the training ranks (split "
        "placement; on GPU one GPU each, after the ranks'; no --tensor-parallel-size). 0: every "
        "training rank holds an engine (colocated).", "Parallelism", ge=0)
    partial_rollouts: bool | None = opt(
        None, "Partial rollouts (in-flight weight updates): weights the ranks publish while a "
        "rollout generates reach its engines between two decode steps, the requests they hold "
        "kept, every token carries the version that sampled it, and a step trains the groups that "
        "finish first within their K-step deadlines. Needs --rollout-world-size and --off-policy-steps "
        ">= 1. What finishes when is timing's, so a run does not repeat and a resume is not "
        "bit-exact; --whole-rounds: each rollout loads weights once, at its start, and both are "
        "exact.", "Parallelism",
        shown="on with --rollout-world-size and --off-policy-steps >= 1, else off", off_flag="--whole-rounds")
    cut_at_deadline: bool = opt(
        False, "With --partial-rollouts: a sample still generating when its group must train (its "
        "rollout's weights K updates behind the trainer's) ends at its engine's next decode step "
        "(a multi-turn trajectory between turns), finish length, its tokens kept, instead of the "
        "trainer waiting for it. Keeps the engines busy at a small K on a long tail; the longest "
        "answers are cut, as --max-tokens cuts them.", "Parallelism")
    cpu_threads: int | None = opt(None, "torch threads of each CPU rank. The ranks' OpenMP threads wait "
                                  "passively (OMP_WAIT_POLICY=PASSIVE unless set; a ~0.3 ms spin first "
                                  "when no other task is runnable at start-up), so a busy neighbour "
                                  "slows them without stalling them.", "Parallelism", ge=1,
                                  shown="cores / ranks on this node (at K >= 1 / ranks + engine processes), at least 1")
    nnodes: int = opt(1, "Nodes in the run (as torchrun's --nnodes): every node runs the same "
                      "command with its own --node-rank and ARENO_BACKEND_AUTHKEY.", "Parallelism", ge=1)
    node_rank: int = opt(0, "This node, 0 .. --nnodes - 1; node 0 runs the controller.",
                         "Parallelism", ge=0)
    nproc_per_node: int | None = opt(None, "Ranks (each with its rollout engine) on this node.",
                                     "Parallelism", ge=1, shown="its GPUs, 1 on CPU")
    master_addr: str = opt("127.0.0.1", "Node 0's address, reachable from every node.",
                           "Parallelism")
    master_port: int = opt(29500, "Rendezvous port on node 0; its controller listens on the next "
                           "port.", "Parallelism", ge=1, le=65534)
    strategy: Strategy = opt(
        "auto", "Data parallelism: auto (fsdp2, which also runs on CPU under gloo; one rank: no wrapper), "
        "fsdp2 or ddp.", "Parallelism")
    # -- Logging and checkpoints -------------------------------------------------
    max_steps: int | None = opt(None, "Stop after this many steps.", "Logging and checkpoints",
                                ge=1, shown="unset (run --epochs)")
    stop_at_reward: float | None = opt(
        None, f"End the run once the mean reward of the last {STOP_WINDOW} steps' samples (all of them, "
        "under --dynamic-sampling too) reaches this; the final eval and save follow, as at --max-steps.",
        "Logging and checkpoints", shown="unset (never)")
    epochs: int = opt(1, "Passes over the dataset (a run stops at whichever limit comes first).",
                      "Logging and checkpoints", ge=1)
    seed: int = opt(0, "Seed of data order, sampling and initialisation.",
                    "Logging and checkpoints", ge=0)  # numpy refuses a negative seed
    output_dir: str | None = opt(
        None, "Run directory (config.yaml, metrics.jsonl, checkpoints).",
        "Logging and checkpoints", shown="runs/<timestamp>")
    report_to: Literal["none", "tensorboard", "wandb"] = opt(
        "none", "Also log metrics to TensorBoard or W&B (if installed).", "Logging and checkpoints")
    log_completions: int = opt(
        2, "Sampled completions per step written to <output-dir>/completions.jsonl (prompt, "
        "completion, reward, advantage, finish reason); the terminal shows one every "
        "10 steps. 0: none.", "Logging and checkpoints", ge=0)
    verbose: bool = opt(
        False, "Show third-party output (warnings, logs and progress bars of vLLM, torch, "
        "transformers) on the terminal too; by default it goes only to <output-dir>/run.log.",
        "Logging and checkpoints")
    save_interval: int = opt(0, "Save a checkpoint every N steps (0: only at the end).",
                             "Logging and checkpoints", ge=0)
    save_path: str | None = opt(None, "Checkpoint directory.", "Logging and checkpoints",
                                shown="<output-dir>/checkpoints")
    keep_last: int = opt(2, "Keep only the newest N checkpoints (0 = keep all).",
                         "Logging and checkpoints", ge=0)
    no_save: bool = opt(False, "Write no checkpoint at all.", "Logging and checkpoints")
    resume: str | None = opt(
        None, "Resume from a checkpoint: 'latest' (the newest complete one under the save path) "
        "or a checkpoint directory. Continues the same data order, optimizer and RNG state.",
        "Logging and checkpoints", shown="unset (a fresh run)")
    eval_dataset_path: str | None = opt(
        None, "Held-out dataset (same forms as --dataset-path) scored with the reward plugin.",
        "Logging and checkpoints", shown="unset (no evaluation)")
    eval_split: str = opt("test", "Split of --eval-dataset-path.", "Logging and checkpoints")
    eval_interval: int = opt(0, "Evaluate every N steps (0: only at step 0 and at the end).",
                             "Logging and checkpoints", ge=0)
    eval_n: int = opt(1, "Also report mean@k over k samples per prompt at --temperature "
                      "(1: greedy pass@1 only).", "Logging and checkpoints", ge=1)
    eval_max_prompts: int | None = opt(None, "Evaluate on at most this many prompts.",
                                       "Logging and checkpoints", ge=1, shown="all")
    eval_only: bool = opt(False, "Evaluate --ckpt on --eval-dataset-path and exit (no training).",
                          "Logging and checkpoints")

    # ------------------------------------------------------------------------
    def __post_init__(self) -> None:
        # Resolve the --algo-dependent default here, so config.yaml and the loss see
        # the value that is used (an unknown --algo is left to validate()).
        if self.loss_agg is None:
            self.loss_agg = LOSS_AGG_BY_ALGO.get(self.algo, "token-mean")
        # LoRA defaults that follow the rank (a bad rank is left to validate()).
        lora = isinstance(self.lora_rank, int) and self.lora_rank > 0
        if self.lr is None:
            self.lr = FULL_FT_LR * (LORA_LR_FACTOR if lora else 1)
        if self.lora_alpha is None and lora:
            self.lora_alpha = float(2 * self.lora_rank)

    @property
    def is_demo(self) -> bool:
        return self.ckpt is None and self.dataset_path is None

    def loss_eps(self) -> tuple[float, float]:
        low, high = (0.2, 0.2) if self.algo == "grpo" else (3e-4, 4e-4)
        return (low if self.clip_eps_low is None else self.clip_eps_low,
                high if self.clip_eps_high is None else self.clip_eps_high)

    to_dict = dataclasses.asdict

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def from_sources(cls, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                     ) -> "TrainConfig":
        """YAML (flat keys, or nested under group names) < explicit overrides < demo preset
        (only for keys neither gave), then validate."""
        values: dict[str, Any] = {}
        if yaml_path is not None:
            from areno.config.file import read_config_file  # yaml loads only for --config

            values.update(read_config_file(yaml_path))
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        check_reward_timeout(values)
        # Resuming, the checkpoint's config fills what was not given (resume.py): its
        # --off-policy-steps came with what it turned on, and the rules are checked there.
        turned_on = off_policy_defaults(values) if values.get("resume") is None else []
        fill_demo_preset(values)
        cfg = cls(**values)
        cfg.validate()
        if turned_on:  # beside "resuming with": the settings a run did not say it wants
            print(turned_on_line(cfg.off_policy_steps, turned_on), flush=True)
        return cfg

    def validate(self) -> None:
        """Each value against its type, choices and bounds (fieldcheck.py), then the
        rules between options (rules.py); a mistake raises UserError."""
        hints = _type_hints()
        for f in dataclasses.fields(self):
            check_value(f, hints[f.name], getattr(self, f.name))
        check_rules(self)


@functools.cache
def _type_hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def field_type(name: str) -> Any:
    return base_type(_type_hints()[name])
