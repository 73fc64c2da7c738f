"""The training loop. A step: take the next filled batch (the run's scheduler,
scheduler.py: rollout, decode, reward, as deep as --off-policy-steps lets it
run ahead), learn from it (advantages, pack, backend.train), publish the new
weights to the engines, log, save. `run.py` builds what a step needs; this
module is the loop itself, one call per phase."""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from areno.advantages import advantages_and_keep
from areno.backend.controller import TrainSteps
from areno.procs.errors import BackendError
from areno.backend.launch import EarlyPeers
from areno.dynsample import Filled
from areno.rundir.completions import completion_records
from areno.rundir.checkpoint import checkpoint_root, latest_checkpoint
from areno.config.env import max_policy_tokens
from areno.config.train import STOP_WINDOW, TrainConfig
from areno.runtime.interrupt import interrupted, interrupted_at_startup, made_run_dir
from areno.procs.signals import interrupts_raise, raise_dropped, raise_held, run_ending, step_window
from areno.metrics import train_metrics
from areno.split import build_split_pack
from areno.rewards import RewardError, RewardResult
from areno.rollout.batch import FINISH_LENGTH, RolloutBatch, overlong_mask
from areno.rollout.probe import WeightSyncError
from areno.runtime.multinode import run_worker_node
from areno.run import Run, open_run
from areno.runtime.startline import steps_text
from areno.runtime.placement import visible_gpus
from areno.stats import StreamingStats
from areno.timing import PhaseTimer  # noqa: F401 (the benchmarks' timing hook lives there)


def train_step(run: Run, step: int, timer: PhaseTimer | None = None,
               update_starts: Callable[[], None] = lambda: None) -> dict[str, float]:
    """One step: take the next filled batch, learn from it, publish the new weights
    -> the step's metrics (train_loop logs and saves). timer: the caller's
    PhaseTimer (benchmarks keep its spans); update_starts: called as the update
    begins (the loop's step_window)."""
    timer, t_step = timer or PhaseTimer(), time.perf_counter()
    filled, loop = run.rollouts.next_batch(step, timer)
    learned = learn(run, step, filled, timer, update_starts)
    with timer("weight_sync"):
        synced = run.rollouts.publish(step, bool(learned.opt_steps))
    result = learned.result(filled, timer, time.perf_counter() - t_step, run.sampler.epoch, synced)
    return step_metrics(result) | filled.metrics() | filled.round.extra | loop


@dataclass(frozen=True)
class Learned:
    """What learn() did with a filled batch."""

    split: Any                          # the SplitPack trained
    trained: Any                        # backend.train's TrainSteps
    opt_steps: list[dict[str, float]]   # its metrics, one per optimizer step
    zero_var_groups: int
    overlong_penalty: float             # mean soft overlong punishment of the scored samples

    def result(self, filled: Filled, timer: PhaseTimer, elapsed: float, epoch: int,
               synced: dict[str, float]) -> "StepResult":
        perf = dict(self.trained.perf)  # perf/train_tokens_per_s, perf/mfu (GPU)
        if "sync_mb" in synced:
            perf["perf/sync_mb"] = synced["sync_mb"]
        if self.opt_steps and "peak_gpu_mem_gb" in self.trained.timings:  # GPU: the largest rank's peak
            perf["perf/peak_gpu_mem_gb"] = self.trained.timings["peak_gpu_mem_gb"]
        prompt_idx, batch, scored = filled.round.astuple()
        return StepResult(batch=batch, scored=scored, prompt_idx=prompt_idx,
                          pack_tokens=self.split.pack.num_tokens, rank_imbalance=self.split.plan.imbalance,
                          zero_var_groups=self.zero_var_groups, opt_steps=self.opt_steps, times=timer.times,
                          elapsed=elapsed, data_epoch=epoch, backend_perf=perf,
                          overlong_penalty=self.overlong_penalty)


def learn(run: Run, step: int, filled: Filled, timer: PhaseTimer,
          update_starts: Callable[[], None]) -> Learned:
    """A scored batch (filled.round; filled.train: which of its groups train,
    dynsample.py) -> advantages, pack, the update."""
    cfg, (prompt_idx, batch, scored) = run.cfg, filled.round.astuple()
    with timer("materialize"):
        with timer.span("advantages"):
            penalty = run.shaping(batch)
            adv, keep, n_zero_var = advantages_and_keep(
                scored.rewards + penalty, scored.valid, batch.group_index, batch.num_prompts,
                overlong_mask(batch),
                mode=cfg.adv_mode, filter_zero_variance=cfg.filter_zero_variance_groups,
                mask_overlong=cfg.mask_overlong)
            keep &= filled.train[batch.group_index]
        with timer.span("pack"):
            split = build_split_pack(
                batch, adv, world_size=run.world_size, max_tokens=run.max_tokens_per_micro,
                num_minibatches=cfg.mini_batches, loss_agg=cfg.loss_agg,
                norm_len=max_policy_tokens(cfg), keep=keep, workspace=run.workspace,
            )
    if cfg.log_completions:
        shown = None if cfg.agent_path else run.prompts.texts  # an agent's prompt is its conversation's
        run.logger.stage_completions(completion_records(
            step, cfg.log_completions, run.tokenizer, shown, prompt_idx, batch, scored.rewards, adv))
    update_starts()  # from the update on, an interrupt waits for the step to end
    with timer("train"):  # each rank sleeps its own engine meanwhile (RankWorker.cmd_train)
        trained = run.backend.train(split) if split.pack.num_seqs else TrainSteps()
        opt_steps = list(trained)
    return Learned(split, trained, opt_steps, n_zero_var,
                   float(penalty[scored.valid].mean()) if scored.valid.any() else 0.0)


@dataclass(frozen=True)
class StepResult:
    """What one step produced, as its metrics need it."""

    batch: RolloutBatch
    scored: RewardResult
    prompt_idx: np.ndarray                # int64 [P], the prompts the step drew
    pack_tokens: int                      # tokens in the train pack
    rank_imbalance: float                 # the pack plan's token imbalance over ranks
    zero_var_groups: int                  # groups whose rewards were all equal
    opt_steps: list[dict[str, float]]     # backend.train's metrics, one per optimizer step
    times: dict[str, float]               # seconds per phase
    elapsed: float                        # seconds of the whole step
    data_epoch: int                       # the sampler's epoch after drawing the prompts
    backend_perf: dict[str, float]        # perf/* of the last backend.train call
    overlong_penalty: float = 0.0         # mean soft overlong punishment of the scored samples


def step_metrics(res: StepResult) -> dict[str, float]:
    """Every per-step metric (see README, "Metrics"), all finite floats."""
    batch, scored = res.batch, res.scored
    r = scored.rewards[scored.valid]
    lengths = batch.response_lengths
    step_lp = StreamingStats()
    step_lp.update(batch.response_logprobs if batch.response_mask is None
                   else batch.response_logprobs[batch.policy_mask])
    c = scored.counts
    m: dict[str, float] = {
        "reward/mean": float(r.mean()) if r.size else 0.0,
        "reward/std": float(r.std()) if r.size else 0.0,
        "reward/accuracy": float((r >= 1.0).mean()) if r.size else 0.0,
        "reward/valid": float(scored.valid.sum()),
        "reward/errors": float(c.errors), "reward/timeouts": float(c.timeouts),
        "reward/nan": float(c.nan), "reward/worker_crashes": float(c.worker_crashes),
        "reward/skipped": float(c.skipped), "reward/zeroed": float(c.zeroed),
        "reward/overlong_penalty": res.overlong_penalty,
        "response/len_mean": float(lengths.mean()) if lengths.size else 0.0,
        "response/len_max": float(lengths.max()) if lengths.size else 0.0,
        "response/truncated_frac": float((batch.finish_reason == FINISH_LENGTH).mean()),
        "rollout/logprob_mean": step_lp.mean if step_lp.count else 0.0,
        "rollout/logprob_std": step_lp.std if step_lp.count > 1 else 0.0,
        "batch/zero_var_groups": float(res.zero_var_groups),
        "batch/pack_tokens": float(res.pack_tokens),
        "batch/rank_imbalance": float(res.rank_imbalance),
        "data/epoch": float(res.data_epoch),
    }
    m.update(train_metrics(res.opt_steps))  # reduced over the optimizer steps by the table
    for phase, t in res.times.items():
        m[f"time/{phase}"] = t
    m["time/step"] = res.elapsed
    m["perf/tokens_per_s"] = float(lengths.sum()) / max(res.elapsed, 1e-9)
    m["data/prompt_hash"] = prompt_hash(res.prompt_idx)
    m.update(res.backend_perf)
    return m


def prompt_hash(prompt_idx: np.ndarray) -> float:
    """Which prompts a step drew, as one float (48 bits of blake2b over the int64
    indices, exact in float64): equal across runs iff the data order is."""
    digest = hashlib.blake2b(np.ascontiguousarray(prompt_idx, dtype=np.int64).tobytes(),
                             digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


def run_training(cfg: TrainConfig, engine: Any = None, early: EarlyPeers | None = None) -> None:
    """`areno train`: the whole run, from an opened Run to the final checkpoint.
    engine, early: see run.open_run."""
    if cfg.node_rank > 0:  # a worker node: its ranks serve node 0's controller
        raise SystemExit(run_worker_node(cfg.nnodes, cfg.node_rank, cfg.nproc_per_node or
                                         visible_gpus() or 1, cfg.master_addr, cfg.master_port))
    run, started = None, -1
    made_run_dir(None)
    with interrupts_raise():
        try:
            raise_held()  # a Ctrl-C during the imports: the start-up message now
            with open_run(cfg, engine, early) as run:
                if cfg.eval_only:
                    run.evaluate(0)
                    return
                if run.step == 0:  # the starting point; a resumed run's is in its metrics already
                    run.evaluate(0)
                started = run.step
                train_loop(run)
        except KeyboardInterrupt:  # the loop handles its own: this one came before its first step
            if run is not None and run.step > started:  # or once the run was done, as it closed
                interrupted(run)
            if run is not None and run.dead is not None:  # a rank or engine process died, not a Ctrl-C
                stopped(run, run.dead)
            interrupted_at_startup(cfg)


def train_loop(run: Run) -> None:
    """Steps run.step + 1 .. run.total_steps, then the final eval and save; an
    interrupt or a backend failure inside ends the run here (exit 130 / 1)."""
    cfg = run.cfg
    before = None
    try:
        for step in range(run.step + 1, run.total_steps + 1):
            raise_dropped()
            before = (step, run.backend.step)
            # From the step's update to its save an interrupt waits (signals.step_window):
            # once the update reached the weights, finishing the step is the only way to
            # save it whole; a Ctrl-C inside a save would abort it, and the backend.
            with step_window() as update_starts:
                metrics = train_step(run, step, update_starts=update_starts)
                run.step = step
                # every generated sample's: under --dynamic-sampling reward/mean is the kept groups'
                run.recent_rewards = [*run.recent_rewards, metrics["sampling/reward_generated"]][-STOP_WINDOW:]
                run.logger.log(step, metrics)
                if not cfg.no_save and due(step, cfg.save_interval):
                    run.save(step)
            if due(step, cfg.eval_interval):
                run.evaluate(step)
            if reward_reached(run.recent_rewards, cfg.stop_at_reward):
                run.logger.info(f"the mean reward of the last {STOP_WINDOW} steps reached "
                                f"--stop-at-reward {cfg.stop_at_reward:g}")
                break
    except (BackendError, WeightSyncError) as e:  # every process is stopped on the way out
        stopped(run, e)
    except RewardError as e:  # the plugin's failure (exit 2); the steps before it are saved
        raise RewardError(f"{e}{resume_note(run)}") from None
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or the backend's watchdog (a rank died)
        if run.dead is not None:
            stopped(run, run.dead)
        settle_interrupted_step(run, before)
        interrupted(run)
    # The end: the last step is evaluated and saved, unless the loop just did (or --no-save).
    # An interrupt here ends as one in the loop does, and the save, as there, ends whole.
    try:
        if not due(run.step, cfg.eval_interval):
            run.evaluate(run.step)
        if not cfg.no_save and not due(run.step, cfg.save_interval):
            with step_window() as save_starts:
                save_starts()
                run.save(run.step)
    except (BackendError, WeightSyncError) as e:
        stopped(run, e)
    except KeyboardInterrupt:
        if run.dead is not None:
            stopped(run, run.dead)
        settle_interrupted_step(run, None)
        interrupted(run)
    run.logger.info(f"done: {steps_text(run.step)}; metrics in {run.logger.metrics_path}")


def reward_reached(recent: list[float], target: float | None) -> bool:
    """Whether --stop-at-reward ends the run: the last STOP_WINDOW steps' mean rewards
    (recent, oldest first) average at least `target`; never with fewer steps."""
    return target is not None and len(recent) >= STOP_WINDOW and float(np.mean(recent[-STOP_WINDOW:])) >= target


def due(step: int, interval: int) -> bool:
    """Whether something done every `interval` steps (0: never) falls on `step`."""
    return bool(interval) and step % interval == 0


def settle_interrupted_step(run: Run, before: tuple[int, int] | None) -> None:
    """Make run.step and the data cursor agree with the weights after an interrupt
    inside a step (before: the step and the backend's update count as it began):
    if its update reached the weights the step counts as finished, otherwise its
    rounds are taken again (scheduler.Rollouts.put_back). The rounds in flight
    are kept when whole, for the checkpoint, or dropped with their prompts back."""
    if before is not None and before[0] == run.step + 1:
        step, backend_step = before
        if run.backend.step != backend_step:
            run.step = step
            run.rollouts.taken = []
        else:
            run.rollouts.put_back()
    if (state := run.rollouts.settle_interrupt(run.step)) is not None:
        run.sampler.load_state_dict(state)


def stopped(run: Run, e: BackendError | WeightSyncError) -> None:
    """Report a backend or engine failure as one line naming the step and the
    checkpoint to resume from, and exit 1. A rank's traceback goes to run.log."""
    # The backend's watchdog may also have seen the death and be about to interrupt
    # this thread (SIGINT); from here on the run is stopping anyway.
    run_ending()
    tb = getattr(e, "remote_traceback", None)
    log = run.output_dir / "run.log"
    if tb:
        with open(log, "a") as f:
            f.write(tb)
    message = getattr(e, "remote_message", None) or str(e)
    print(f"areno: error: training stopped in step {run.step + 1}: {message}{resume_note(run)}"
          + (f" (rank traceback in {log})" if tb else ""),
          file=sys.stderr, flush=True)
    raise SystemExit(1)


def resume_note(run: Run) -> str:
    """How a failed run continues: "; continue from ... --resume CKPT", or that none was written."""
    last = latest_checkpoint(checkpoint_root(run.cfg, run.output_dir))
    return (f"; continue from the last complete checkpoint with --resume {last}" if last
            else "; no checkpoint was written yet")
