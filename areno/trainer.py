"""The training loop: rollout -> decode -> reward -> advantages -> pack ->
backend.train -> weight sync -> log. `run.py` builds what a step needs;
this module is the loop itself, one call per phase."""

from __future__ import annotations

import hashlib
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from areno.advantages import advantages_and_keep, overlong_penalty
from areno.backend.controller import TrainSteps
from areno.procs.errors import BackendError
from areno.backend.launch import EarlyPeers
from areno.envs.driver import env_rollout
from areno.dynsample import Filled, Round, fill_batch, informative_groups, round_sampling
from areno.rundir.completions import completion_records
from areno.rundir.checkpoint import checkpoint_root, latest_checkpoint
from areno.config.train import TrainConfig
from areno.data.prompts import select
from areno.runtime.interrupt import interrupted, interrupted_at_startup, made_run_dir
from areno.procs.signals import interrupts_raise, raise_held, step_window
from areno.metrics import train_metrics
from areno.split import build_split_pack
from areno.rewards import RewardError, RewardResult
from areno.rollout.batch import FINISH_LENGTH, RolloutBatch, overlong_mask
from areno.rollout.engine import SamplingConfig
from areno.rollout.probe import WeightSyncError
from areno.runtime.multinode import run_worker_node
from areno.run import Run, open_run, steps_text
from areno.runtime.placement import visible_gpus
from areno.scoring import PartScorer, score
from areno.stats import StreamingStats
from areno.timing import PhaseTimer  # noqa: F401 (the benchmarks' timing hook lives there)


def train_step(run: Run, step: int, timer: PhaseTimer | None = None,
               update_starts: Callable[[], None] = lambda: None) -> dict[str, float]:
    """One synchronous step; timer: the caller's PhaseTimer (benchmarks keep its spans);
    update_starts: called as the update begins (the loop's step_window)."""
    timer = timer or PhaseTimer()
    t_step = time.perf_counter()
    filled = sample_rounds(run, colocated_round(run, step, timer))
    return learn(run, step, filled, timer, t_step, run.engine.sync_weights, update_starts)


def colocated_round(run: Run, step: int, timer: PhaseTimer) -> Callable[[int], Round]:
    """collect(r): draw --batch-size prompts, generate round r of `step` with the
    engines in the ranks, score it."""
    def collect(r: int) -> Round:
        prompt_idx = run.sampler.next_batch()
        sampling = round_sampling(run.sampling_for(step), r)
        if run.cfg.env_path:  # multi-turn: the environment's rewards (envs/driver.py)
            return Round(prompt_idx, *env_rollout(run, prompt_idx, sampling, timer))
        rollout = rollout_overlapped if run.cfg.overlap_rewards else rollout_then_score
        return Round(prompt_idx, *rollout(run, prompt_idx, sampling, timer))
    return collect


def sample_rounds(run: Run, collect: Callable[[int], Round]) -> Filled:
    """One round (--dynamic-sampling off), or rounds until the batch is full of
    informative groups (dynsample.fill_batch)."""
    cfg = run.cfg
    if cfg.dynamic_sampling == "off":
        return Filled.whole(collect(0))

    def informative(r: Round) -> np.ndarray:
        return informative_groups(r.scored.rewards + shaping(cfg, r.batch), r.scored.valid,
                                  r.batch.group_index, r.batch.num_prompts, cfg.dynamic_sampling)
    return fill_batch(collect, cfg.batch_size, cfg.max_sampling_rounds, informative)


def train_step_ahead(run: Run, step: int, timer: PhaseTimer | None = None,
                     update_starts: Callable[[], None] = lambda: None) -> dict[str, float]:
    """One step of the asynchronous loop (asyncloop.py): train on a rollout that
    was generated, decoded and scored while earlier steps trained; the next ones
    run meanwhile."""
    timer, t_step = timer or PhaseTimer(), time.perf_counter()
    ahead = run.ahead
    cur = ahead.take(step, timer)

    def collect(r: int) -> Round:  # round 0: the loop's rollout, scored; a refill: generated now (K = 0)
        if r == 0:
            return Round(cur.prompt_idx, cur.batch, cur.scored)
        with timer("rollout"):
            prompt_idx, batch = ahead.extra_round(step, round_sampling(run.sampling_for(step), r))
        return Round(prompt_idx, batch, score(run, prompt_idx, batch, timer))
    metrics = learn(run, step, sample_rounds(run, collect), timer, t_step, ahead.publish, update_starts)
    return metrics | ahead.after_update(step, cur)


def learn(run: Run, step: int, filled: Filled, timer: PhaseTimer, t_step: float,
          sync: Callable[[], Any], update_starts: Callable[[], None]) -> dict[str, float]:
    """A scored rollout (filled.round; filled.train: which of its groups train,
    dynsample.py) -> advantages, pack, update, `sync()` (new weights to the
    engines -> their timings, or published for them -> None), the step's metrics."""
    cfg, (prompt_idx, batch, scored) = run.cfg, filled.round.astuple()
    with timer("materialize"):
        with timer.span("advantages"):
            penalty = shaping(cfg, batch)
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
                norm_len=cfg.max_new_tokens, keep=keep, workspace=run.workspace,
            )
    if cfg.log_completions:
        run.logger.stage_completions(completion_records(
            step, cfg.log_completions, run.tokenizer, run.prompts.texts, prompt_idx, batch,
            scored.rewards, adv))
    update_starts()  # from the update on, an interrupt waits for the step to end
    with timer("train"):  # each rank sleeps its own engine meanwhile (RankWorker.cmd_train)
        trained = run.backend.train(split) if split.pack.num_seqs else TrainSteps()
        opt_steps = list(trained)
    synced = {}
    with timer("weight_sync"):
        if opt_steps:
            synced = sync() or {}
    elapsed = time.perf_counter() - t_step
    perf = dict(trained.perf)  # perf/train_tokens_per_s, perf/mfu (GPU)
    if "sync_mb" in synced:
        perf["perf/sync_mb"] = synced["sync_mb"]
    if opt_steps and "peak_gpu_mem_gb" in trained.timings:  # GPU only: the largest rank's allocator peak
        perf["perf/peak_gpu_mem_gb"] = trained.timings["peak_gpu_mem_gb"]
    return step_metrics(StepResult(
        batch=batch, scored=scored, prompt_idx=prompt_idx, pack_tokens=split.pack.num_tokens,
        rank_imbalance=split.plan.imbalance, zero_var_groups=n_zero_var, opt_steps=opt_steps,
        times=timer.times, elapsed=elapsed, data_epoch=run.sampler.epoch, backend_perf=perf,
        overlong_penalty=float(penalty[scored.valid].mean()) if scored.valid.any() else 0.0)
    ) | filled.metrics() | filled.round.extra


def shaping(cfg: TrainConfig, batch: RolloutBatch) -> np.ndarray:
    """[N] float32 added to the plugin's rewards before advantages: DAPO's soft
    overlong punishment (--overlong-buffer; zeros when off)."""
    return overlong_penalty(batch.response_lengths, cfg.max_new_tokens, cfg.overlong_buffer,
                            cfg.overlong_penalty)


def rollout_then_score(run: Run, prompt_idx: np.ndarray, sampling: SamplingConfig,
                       timer: PhaseTimer) -> tuple[RolloutBatch, RewardResult]:
    """Generate everything, then decode in one call, then score."""
    with timer("rollout"):
        ids, offsets = select(run.prompts, prompt_idx)
        batch = run.engine.generate(ids, offsets, run.cfg.n_samples, sampling)
    return batch, score(run, prompt_idx, batch, timer)


def rollout_overlapped(run: Run, prompt_idx: np.ndarray, sampling: SamplingConfig,
                       timer: PhaseTimer) -> tuple[RolloutBatch, RewardResult]:
    """Decode and submit each part of the rollout to the reward workers as its
    groups finish (scoring.PartScorer); after the last one only the outstanding
    rewards are waited for. time/rollout includes the overlapped decode;
    time/reward is what remains."""
    scorer = PartScorer(run, prompt_idx, timer)
    with timer("rollout"):
        ids, offsets = select(run.prompts, prompt_idx)
        # Every finished group goes out at once: the last part, whose scoring
        # cannot hide behind generation, stays as small as possible (with parts of
        # P/4 groups a quarter of the reward time stayed on the critical path).
        for pos, part in run.engine.generate_stream(ids, offsets, run.cfg.n_samples, sampling, min_groups=1):
            scorer.add(pos, part)
    return scorer.finish(timer)


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
            if run is not None and run.backend.dead is not None:  # a rank died, not a Ctrl-C
                stopped(run, run.backend.dead)
            interrupted_at_startup(cfg)


def train_loop(run: Run) -> None:
    """Steps run.step + 1 .. run.total_steps, then the final eval and save; an
    interrupt or a backend failure inside ends the run here (exit 130 / 1)."""
    cfg = run.cfg
    before = None
    try:
        for step in range(run.step + 1, run.total_steps + 1):
            before = (step, sampler_before(run, step), run.backend.step)
            # From the step's update to its save an interrupt waits (signals.step_window):
            # once the update reached the weights, finishing the step is the only way to
            # save it whole; a Ctrl-C inside a save would abort it, and the backend.
            with step_window() as update_starts:
                metrics = (train_step_ahead if run.ahead else train_step)(run, step, update_starts=update_starts)
                run.step = step
                run.logger.log(step, metrics)
                if not cfg.no_save and due(step, cfg.save_interval):
                    run.save(step)
            if due(step, cfg.eval_interval):
                run.evaluate(step)
    except (BackendError, WeightSyncError) as e:  # every process is stopped on the way out
        stopped(run, e)
    except RewardError as e:  # the plugin's failure (exit 2); the steps before it are saved
        raise RewardError(f"{e}{resume_note(run)}") from None
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or the backend's watchdog (a rank died)
        if run.backend is not None and run.backend.dead is not None:
            stopped(run, run.backend.dead)
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
        if run.backend is not None and run.backend.dead is not None:
            stopped(run, run.backend.dead)
        settle_interrupted_step(run, None)
        interrupted(run)
    run.logger.info(f"done: {steps_text(run.step)}; metrics in {run.logger.metrics_path}")


def due(step: int, interval: int) -> bool:
    """Whether something done every `interval` steps (0: never) falls on `step`."""
    return bool(interval) and step % interval == 0


def sampler_before(run: Run, step: int) -> dict:
    """The sampler's state before step drew its prompts (the asynchronous loop drew
    them during an earlier step)."""
    cur = run.ahead.inflight[0] if run.ahead and run.ahead.inflight else None
    return cur.sampler_before if cur and cur.step == step else run.sampler.state_dict()


def settle_interrupted_step(run: Run, before: tuple[int, dict, int] | None) -> None:
    """Make run.step and the data cursor agree with the weights after an interrupt
    inside a step: if its update reached the weights the step counts as finished,
    otherwise the prompts it drew go back to the sampler (the asynchronous loop
    keeps its rollout in flight instead). The loop's rollouts for later steps are
    kept when whole, for the checkpoint, or dropped with their prompts back
    (asyncloop.RolloutsAhead.settle_interrupt)."""
    ahead = run.ahead
    if before is not None and before[0] == run.step + 1:
        step, sampler_state, backend_step = before
        if run.backend.step != backend_step:
            run.step = step
        elif ahead is None:
            run.sampler.load_state_dict(sampler_state)
        else:
            ahead.put_back(step)
    if ahead is not None and (state := ahead.settle_interrupt(run.step)) is not None:
        run.sampler.load_state_dict(state)


def stopped(run: Run, e: BackendError | WeightSyncError) -> None:
    """Report a backend or engine failure as one line naming the step and the
    checkpoint to resume from, and exit 1. A rank's traceback goes to run.log."""
    # The backend's watchdog may also have seen the death and be about to interrupt
    # this thread (SIGINT); from here on the run is stopping anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
