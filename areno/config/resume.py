"""Which options a resumed run takes from its checkpoint and which it may change
(finding and restoring the checkpoint is rundir.resume.Resume's).

A resumed run must compute the same steps as the run that was saved, so an
option that changes what a step computes (model, data, sampling, algorithm,
optimizer, batch shape, seed) keeps its saved value: giving another one is a
user error. What may change is where and how much is logged, saved and
evaluated, the resources a step uses, how rewards are run, and the run's length
(a longer --max-steps moves the LR schedule's horizon with it: step k then gets
the LR a run started with the longer --max-steps gives it). Of the asynchronous
loop's two options, --rollout-world-size is a resource (how many processes
sample, as --world-size and --tensor-parallel-size) and may change;
--off-policy-steps may not: it decides which policy version samples each
step's batch, that is the data a step trains on, and it brings
--recompute-logprobs and --tis-cap with it, which change the loss; nor may
--partial-rollouts (it decides whether a round's later tokens come from newer
weights). Options not given
on the command line (or in --config) take the checkpoint's values, so
`areno train --output-dir DIR --resume latest` continues the run as it was.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from areno.config.train import TrainConfig
from areno.config.file import read_config_file
from areno.errors import UserError
from areno.config.fieldcheck import flag_name
from areno.config.offpolicy import check_off_policy

# Where the run lives: always this invocation's, never the checkpoint's (a --save-path
# not given is the one the run directory's config.yaml records).
LOCATION: frozenset[str] = frozenset({"output_dir", "save_path", "resume"})
# May differ from the checkpoint's value; applied and printed.
MAY_CHANGE: frozenset[str] = frozenset({
    # run length
    "max_steps", "epochs", "stop_at_reward",
    # logging, checkpoints, evaluation
    "report_to", "log_completions", "save_interval", "keep_last", "no_save", "save_merged", "eval_dataset_path",
    "eval_split",
    "eval_interval", "eval_n", "eval_max_prompts", "verbose",
    # resources (same math): engine, memory, parallelism of the update
    "rollout_engine", "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gb",
    "max_tokens_per_micro", "grad_checkpointing", "world_size", "rollout_world_size", "cpu_threads",
    "max_nan_steps",
    "rank_heartbeat_timeout", "startup_timeout", "command_timeout", "collective_timeout",
    # how rewards run (a fixed plugin or a longer timeout, say)
    "reward_fn_path", "reward_workers", "reward_timeout", "overlap_rewards", "on_reward_error",
})


def given_options(config_path: str | None, flags: dict[str, Any]) -> set[str]:
    """Options the user set: flags given (not None) and keys of the --config file."""
    given = {k for k, v in flags.items() if v is not None}
    if config_path is not None:
        given |= set(read_config_file(config_path))
    return given


def resume_config(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """The config in effect when resuming: the checkpoint's, with the options the
    user gave applied where they may change (printed on one line). cfg without
    --resume. UserError naming every option given that may not change."""
    if cfg.resume is None:
        return cfg
    from areno.rundir.checkpoint import recorded_save_path  # imports torch: a resumed run only
    from areno.rundir.resume import Resume

    if not cfg.save_path and cfg.output_dir:
        # The run saved where its config.yaml says: resume from there and keep saving there.
        cfg = replace(cfg, save_path=recorded_save_path(Path(cfg.output_dir).expanduser()))
    saved = Resume.find(cfg).state.get("config")
    if not isinstance(saved, dict):
        check_off_policy(cfg)
        return cfg  # an older checkpoint without its config: nothing to compare with
    names = [f.name for f in TrainConfig.fields()]
    merged = {n: (getattr(cfg, n) if n in LOCATION or n in given or n not in saved else saved[n])
              for n in names}
    changed = [n for n in names if n not in LOCATION and merged[n] != saved.get(n, merged[n])]
    fixed = [n for n in changed if n not in MAY_CHANGE]
    if fixed:
        raise UserError(
            "--resume: " + ", ".join(_change(n, saved[n], merged[n]) for n in fixed)
            + f": {'this option' if len(fixed) == 1 else 'these options'} cannot change when "
            "resuming (the run would no longer be the one that was saved); drop "
            f"{'it' if len(fixed) == 1 else 'them'}, or start a new run in another --output-dir")
    out = TrainConfig(**merged)
    out.validate()
    # validate() leaves these to the config in effect: --rollout-world-size, say, may be
    # the checkpoint's
    check_off_policy(out)
    if changed:
        print("areno: resuming with " + ", ".join(_change(n, saved[n], merged[n]) for n in changed),
              flush=True)
    return out


def _change(name: str, old: Any, new: Any) -> str:
    return f"{flag_name(name)} {old} -> {new}"

