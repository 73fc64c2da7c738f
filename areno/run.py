"""Build everything a training step needs (`Run`), in the order that surfaces
user mistakes first: run directory, tokenizer, data, reward plugin, then the
expensive parts (backend ranks, rollout engine). Closing a Run shuts down every
process it started, on every exit path. Where those parts go comes from
runtime/placement.py, their settings from settings.py; what a resumed run
takes from its checkpoint, from rundir.resume.Resume."""

from __future__ import annotations

import contextlib
import datetime as _dt
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from areno.advantages import overlong_penalty
from areno.config.env import trajectory_tokens
from areno.envs.pool import EnvPool
from areno.gateway.host import AgentHost
from areno import evaluate as evaluation
from areno.producers import Data
from areno.inflight_file import load_inflight
from areno.scheduler import Rollouts, rollouts_for
from areno import settings
from areno.backend.launch import EarlyPeers
from areno.backend.rank_engines import RankEngines
from areno.fleet.engine_procs import EngineProcs
from areno.fleet.engines import EngineView, ProcEngines
from areno.rundir import lock as runlock
from areno.rundir.resume import Resume
from areno.rundir.checkpoint import (check_free_space, checkpoint_bytes, checkpoint_root, instead_of,
                                    save_checkpoint)
from areno.config.train import TrainConfig
from areno.data.prompts import PromptSet, tokenize_prompts
from areno.data.rows import RowSet, load_rows, normalize_rows
from areno.data.sampler import PromptSampler
from areno.errors import UserError
from areno.data.tokenizer import load_tokenizer
from areno.runtime.interrupt import made_run_dir
from areno.procs.signals import raise_dropped
from areno.runtime.leftovers import clean_leftovers
from areno.rundir.runconfig import write_run_config
from areno.models.directory import (
    MODEL_DIR_FIX, Weights, adapter_base, cached_weights, check_model_dir, is_adapter_dir,
)
from areno.models.info import check_model
from areno.runtime.multinode import controller_port, start_local_ranks
from areno.runtime.multinode import stop as stop_ranks
from areno.runtime.early import spawn_early
from areno.runtime.placement import check_placement, ranks_for, resolve_device
from areno.runtime.shm import check_shm_room
from areno.pack import Workspace
from areno.perf import default_micro_tokens
from areno.rundir.reporting import RunLogger
from areno.runtime.startline import lora_line, start_line
from areno.rewards import RewardScorer
from areno.rollout.engine import SamplingConfig
from areno.rundir.log import third_party_to_log
from areno.timing import startup_mark
from areno.data.tasks import arith, resolve_plugin_path
from areno.models.tiny import tiny_model_path

EVAL_SEED_BASE = 1 << 62  # eval sampling seeds never coincide with a training step's


@dataclass
class Run:
    """What the loop touches each step."""

    cfg: TrainConfig
    output_dir: Path
    model_path: str
    tokenizer: Any
    rows: RowSet | None
    prompts: PromptSet | None
    sampler: PromptSampler | None
    sampling: SamplingConfig
    scorer: RewardScorer | None  # the reward plugin's workers (None under --env-path)
    envs: EnvPool | None         # the environment's workers (--env-path, engines in the ranks)
    backend: Any
    engine: EngineView
    logger: RunLogger
    world_size: int
    total_steps: int
    step: int = 0
    evalset: tuple[RowSet, PromptSet] | None = None
    workspace: Workspace = field(default_factory=Workspace)  # pack buffers reused every step
    max_tokens_per_micro: int = 8192  # --max-tokens-per-micro, or the device's default
    rollouts: Rollouts = None  # type: ignore[assignment]  # the scheduler: set once the engines are up
    agents: AgentHost | None = None  # --agent-path: the agents' workers and the gateway they call
    recent_rewards: list[float] = field(default_factory=list)  # --stop-at-reward: the last steps' generated reward

    @property
    def dead(self) -> Any:
        """Why a watchdog stopped the run (a rank or an engine process died or went
        silent: a BackendError), else None: the interrupt was the user's."""
        found = [p.dead for p in (self.backend, self.engine) if p.dead is not None]
        return found[0] if found else None

    def evaluate(self, step: int) -> None:
        """Score the eval set (--eval-dataset-path; nothing without one) through the
        same producer as training rounds (multi-turn under --env-path), greedy,
        and log it at `step`."""
        cfg = self.cfg
        if self.evalset is None:
            return
        self.rollouts.ready_for_eval()  # the engines free, with the weights of `step`
        # mean@k samples with a seed of its own per step, so a resumed run evaluates as
        # an uninterrupted one would (the engine's own stream is not checkpointed).
        sampling = replace(self.sampling, seed=EVAL_SEED_BASE + self.sampling_for(step).seed)
        m = evaluation.evaluate(self.rollouts.run_round, Data(*self.evalset), sampling, k=cfg.eval_n)
        self.logger.log(step, m, advance=False)
        self.logger.info(f"eval step {step}: " + " ".join(
            f"{k.split('/', 1)[1]} {v:.3f}" for k, v in m.items() if k != "eval/prompts"))

    def sampling_for(self, step: int) -> SamplingConfig:
        """The sampling of step's rollout: its seed is the step's, so a resumed run
        samples as an uninterrupted one."""
        return replace(self.sampling, seed=self.cfg.seed * 1_000_003 + step)

    def shaping(self, batch: Any) -> Any:
        """[N] float32 added to the plugin's rewards before advantages: DAPO's soft
        overlong punishment (--overlong-buffer; zeros when off). Under --env-path
        it is defined on the trajectory: its length (sampled + observation tokens)
        against its budget (--max-trajectory-tokens), where it is cut."""
        cfg = self.cfg
        return overlong_penalty(batch.response_lengths, trajectory_tokens(cfg), cfg.overlong_buffer,
                                cfg.overlong_penalty)

    def save(self, step: int) -> Path:
        """Write a checkpoint of `step` (atomic; pruned to --keep-last)."""
        path = save_checkpoint(self, step)
        self.logger.info(f"saved checkpoint {path}")
        return path


def output_dir_for(cfg: TrainConfig, resume: Resume) -> Path:
    """The run directory: --output-dir, the resumed run's own, or runs/<timestamp>."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser()
    if resume.ckpt is not None and resume.ckpt.parent.name == "checkpoints":
        return resume.ckpt.parent.parent  # the resumed run's own directory
    return Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def make_output_dir(cfg: TrainConfig, resume: Resume | None = None, out: Path | None = None,
                    params: dict | None = None) -> Path:
    """The run directory `out` (output_dir_for's when None), with the run's config.yaml
    written into it (after resume.validate: an existing run there may be a user error).
    params: {trainable, total} parameter counts (LoRA runs), recorded under `params`
    (a key --config skips, so the file still works as a --config)."""
    resume = resume or Resume()
    out = out or output_dir_for(cfg, resume)
    resume.validate(cfg, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(out, cfg.to_dict(), params)
    except OSError as e:
        raise UserError(f"--output-dir {out}: cannot write there ({e.strerror})") from None
    return out


def lock_run_dirs(cfg: TrainConfig, out: Path) -> contextlib.AbstractContextManager:
    """One run per directory: the run directory and the one its checkpoints go to,
    the default <output-dir>/checkpoints too (another run's --save-path may name
    it), held until the run's last process has stopped (rundir/lock.py)."""
    dirs = [(out, "--output-dir")]
    if not (cfg.no_save or cfg.eval_only):
        dirs.append((checkpoint_root(cfg, out), "--save-path" if cfg.save_path else "--output-dir"))
    return runlock.hold(dirs)


def check_save_room(cfg: TrainConfig, out: Path, weights: Weights | None, device: str,
                    lora_params: int | None = None) -> None:
    """Before the first step: the checkpoint directory can be written and has room for
    one checkpoint (estimated from the model's weights; under LoRA, lora_params: the
    adapter's, fp32, plus the merged model with --save-merged), unless nothing is saved."""
    if cfg.no_save or cfg.eval_only:
        return
    root = checkpoint_root(cfg, out)
    flag = "--save-path" if cfg.save_path else "--output-dir"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise UserError(f"{flag} {root}: checkpoints cannot be written there ({e.strerror}); "
                        f"choose another {flag}, or pass --no-save") from None
    if lora_params:
        need = checkpoint_bytes(lora_params, 0, 4)  # fp32 adapters and their AdamW moments
        if cfg.save_merged and weights is not None:
            need += weights.params * 4 if weights.params is not None else weights.nbytes
        check_free_space(root, need, flag)
    elif weights is not None:
        item = getattr(torch, settings.resolved_dtype(cfg, device)).itemsize  # the trained dtype
        check_free_space(root, checkpoint_bytes(weights.params, weights.nbytes, item), flag)


def weight_bytes(weights: Weights | None, item: int) -> int:
    """The full weights in a dtype of `item` bytes (their files' size where the
    element count is unknown; 0 for a model not on this host yet)."""
    if weights is None:
        return 0
    return weights.params * item if weights.params is not None else weights.nbytes


def load_data(cfg: TrainConfig, tokenizer: Any) -> tuple[RowSet, PromptSet]:
    if cfg.dataset_path is None:
        rows = normalize_rows(arith.rows(), source="builtin:arith")
    else:
        rows = load_rows(cfg.dataset_path, split=cfg.dataset_split,
                         loader_fn=cfg.dataset_loader_fn, skip_bad_rows=cfg.skip_bad_rows)
    prompts = tokenize_prompts(rows, tokenizer, use_chat_template=cfg.chat_template,
                               system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len)
    return rows, prompts


def load_eval_data(cfg: TrainConfig, tokenizer: Any) -> tuple[RowSet, PromptSet]:
    rows = load_rows(cfg.eval_dataset_path, split=cfg.eval_split, loader_fn=cfg.dataset_loader_fn,
                     skip_bad_rows=cfg.skip_bad_rows, flag="--eval-dataset-path")
    if cfg.eval_max_prompts:
        rows.rows[:] = rows.rows[: cfg.eval_max_prompts]
    prompts = tokenize_prompts(rows, tokenizer, use_chat_template=cfg.chat_template,
                               system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len)
    return rows, prompts


def model_path_for(cfg: TrainConfig) -> str:
    if cfg.ckpt is not None:
        return cfg.ckpt
    return str(tiny_model_path("arith"))


def total_steps_for(cfg: TrainConfig, sampler: PromptSampler) -> int:
    by_epochs = cfg.epochs * sampler.batches_per_epoch
    return min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs


@contextlib.contextmanager
def open_run(cfg: TrainConfig, engine: Any = None, early: EarlyPeers | None = None) -> Iterator[Run]:
    """Build a Run; everything started is stopped when the block exits.
    engine: a RolloutEngine to use instead of building one (benchmarks, tests);
    early: peers the CLI spawned already (runtime/early.py).
    Third-party output goes to RUN_DIR/run.log from the moment the run dir exists
    until the last process is stopped (areno/rundir/log.py)."""
    with contextlib.ExitStack() as logs, _open_run(cfg, engine, logs, early) as run:
        yield run


def _agent_host(cfg: TrainConfig, tokenizer: Any) -> AgentHost:
    """--agent-path, colocated: the agents' workers and the gateway on this process."""
    return AgentHost(cfg.agent_path, tokenizer, workers=cfg.reward_workers, timeout=cfg.reward_timeout,
                     on_error=cfg.on_reward_error, tool_parser=cfg.agent_tool_parser,
                     concurrency=cfg.agent_concurrency,
                     reward_fn_path=resolve_plugin_path(cfg.reward_fn_path) if cfg.reward_fn_path else None)


@contextlib.contextmanager
def _open_run(cfg: TrainConfig, engine: Any, logs: contextlib.ExitStack,
              early: EarlyPeers | None) -> Iterator[Run]:
    clean_leftovers()  # shared memory of areno processes that were SIGKILLed
    device = resolve_device(cfg)
    nproc, world_size = ranks_for(cfg, device)
    check_placement(cfg, nproc, world_size, device)
    resume = Resume.find(cfg)  # a bad checkpoint is one line here (checkpoint.check_checkpoint)
    inflight = load_inflight(resume.ckpt, resume.state.get("inflight"),  # its rollouts in flight too
                             instead_of(resume.ckpt) if resume.ckpt else "")
    model_path, base_model, weights, lora, params = model_for(cfg, resume)
    out = output_dir_for(cfg, resume)
    logs.enter_context(lock_run_dirs(cfg, out))  # before anything in it is changed
    make_output_dir(cfg, resume, out, params=params)
    made_run_dir(out)  # an interrupt before the first step names what was written
    logs.enter_context(third_party_to_log(out, cfg.verbose))
    check_save_room(cfg, out, weights, device, lora_params=params and params["trainable"])
    item = getattr(torch, settings.resolved_dtype(cfg, device)).itemsize  # the engines' dtype
    check_shm_room(cfg, weight_bytes(weights, item), (params["trainable"] if params else 0) * item,
                   cfg.rollout_world_size or nproc)
    early = spawn_early(cfg, world_size, device, settings.engine_gpus(cfg, device), logs, early)
    startup_mark("run dir ready")
    tokenizer = load_tokenizer(model_path)
    startup_mark("tokenizer loaded")
    rows, prompts = (None, None) if cfg.eval_only else load_data(cfg, tokenizer)
    evalset = load_eval_data(cfg, tokenizer) if cfg.eval_dataset_path else None
    sampler = PromptSampler(len(prompts), cfg.batch_size, cfg.seed) if prompts else None
    resume.restore_sampler(sampler)  # a changed dataset is a UserError, before anything starts
    total = total_steps_for(cfg, sampler) if sampler else 0
    longest = max(int(p.lengths.max()) for p in (prompts, evalset and evalset[1]) if p)
    check_model(model_path, longest, trajectory_tokens(cfg))  # before any engine or rank starts
    with contextlib.ExitStack() as stack:
        scorer, envs = scorer_for(cfg, stack)
        # The ranks hold the rollout engines, so an eval-only run starts them too.
        spec = None if engine is not None else settings.engine_spec(cfg, device, longest, lora.rank if lora else 0)
        bcfg = settings.backend_config(cfg, model_path, base_model, world_size, device, max(total, 1), spec,
                                       lora=lora)
        backend, engine = _start_processes(cfg, bcfg, nproc, early, engine, resume, stack)
        logger = stack.enter_context(RunLogger(out, total, cfg.report_to, config=cfg.to_dict(),
                                               start_step=resume.step, completions=bool(cfg.log_completions)))
        run = Run(cfg=cfg, output_dir=out, model_path=base_model, tokenizer=tokenizer, rows=rows, prompts=prompts,
                  sampler=sampler, sampling=settings.sampling(cfg), scorer=scorer, envs=envs, backend=backend,
                  engine=engine, logger=logger, world_size=world_size, total_steps=total, step=resume.step,
                  evalset=evalset, max_tokens_per_micro=cfg.max_tokens_per_micro or default_micro_tokens(device),
                  recent_rewards=list(resume.state.get("recent_rewards", [])))
        if cfg.agent_path and not engine.background:
            # Colocated: the gateway on this process, the driver runs here over the ranks'
            # engines. Split placement: each engine process has its own (gateway/host.py).
            run.agents = stack.enter_context(_agent_host(cfg, tokenizer))
        logger.info(start_line(run, resume, device))
        run.rollouts = rollouts_for(run, int(resume.state.get("weight_version", resume.step)), inflight,
                                    model_path)
        if lora is not None:
            logger.info(lora_line(lora, params))
            if lora.adapter_path is not None:  # the engines hold the base model: give them the trained one
                run.engine.sync_weights()
        resume.restore_rng()  # last: engine and backend start-up may reseed the global RNGs
        raise_dropped()  # a Ctrl-C Python dropped during start-up: the start-up message
        yield run


def _start_processes(cfg: TrainConfig, bcfg: Any, nproc: int, early: EarlyPeers | None, engine: Any,
                     resume: Resume, stack: contextlib.ExitStack) -> tuple[Any, Any]:
    """The ranks (nproc of them on this node), and under split placement the engine processes apart from them
    -> (the TorchBackend, the run's EngineView); `engine`: a caller's stand-in,
    used as given. Their shutdown goes on `stack`."""
    # Looked up when called: tests replace it to show user mistakes come before any rank.
    from areno.backend.controller import TorchBackend

    if cfg.nnodes > 1:  # node 0: the controller, plus this node's ranks
        bcfg = replace(bcfg, launcher="external", listen_port=controller_port(cfg.master_port))
        stack.callback(stop_ranks, start_local_ranks(cfg.nnodes, 0, nproc, cfg.master_addr, cfg.master_port))
    fleet = None
    if cfg.rollout_world_size and engine is None:  # split placement: the engine processes, apart
        # Their config first: they build their engines while the ranks load the policy.
        fleet = EngineProcs(bcfg.engine_procs(), early.engines if early is not None else None, wait=False)
        stack.callback(fleet.close)
    backend = TorchBackend(bcfg, early)
    startup_mark("backend ready")
    stack.callback(backend.close)
    resume.restore_backend(backend)
    if fleet is not None:
        engine = ProcEngines(fleet, backend)  # once every engine process said hello
        startup_mark("engine processes ready")
    if engine is None:
        engine = RankEngines(backend, cfg.tensor_parallel_size)
    return backend, engine


def scorer_for(cfg: TrainConfig, stack: contextlib.ExitStack) -> tuple[RewardScorer | None, EnvPool | None]:
    """The reward plugin's workers, or under --env-path the environment's (on the
    same reward workers: its calls, one job each). Engine processes run their own
    environment workers (EngineWorker.cmd_episodes), so split placement starts none here."""
    if cfg.agent_path:
        return None, None  # the agents' workers: AgentHost, made with the run
    if cfg.env_path:
        if cfg.rollout_world_size:
            return None, None
        return None, stack.enter_context(EnvPool(cfg.env_path, workers=cfg.reward_workers,
                                                 timeout=cfg.reward_timeout, on_error=cfg.on_reward_error))
    return stack.enter_context(RewardScorer(resolve_plugin_path(cfg.reward_fn_path), workers=cfg.reward_workers,
                                            timeout=cfg.reward_timeout, on_error=cfg.on_reward_error)), None


def model_for(cfg: TrainConfig, resume: Resume) -> tuple[str, str, Weights | None, Any, dict | None]:
    """(what the ranks load, the base model checkpoints record, its checked weights,
    the LoRA spec or None, the {trainable, total} parameter counts under LoRA): a
    LoRA checkpoint (--ckpt or --resume) loads its base model plus the adapter."""
    base_model = resume.base_model if resume.ckpt else model_path_for(cfg)
    model_path = str(resume.ckpt) if resume.ckpt else base_model
    weights = check_model_dir(model_path, "--resume" if resume.ckpt else "--ckpt", MODEL_DIR_FIX) \
        or cached_weights(model_path)  # a hub id: its cached snapshot, if any
    adapter = None
    if is_adapter_dir(model_path):
        adapter = model_path
        base_model = base_model if resume.ckpt else adapter_base(model_path, "--ckpt")
        model_path = base_model
        weights = check_model_dir(base_model, "--ckpt", MODEL_DIR_FIX)
    lora = settings.lora_spec(cfg, adapter)
    params = None
    if lora is not None:  # the target names against the model, before anything is written
        from areno.backend.lora import lora_plan

        trainable, total = lora_plan(model_path, lora)
        params = {"trainable": trainable, "total": total}
    return model_path, base_model, weights, lora, params
