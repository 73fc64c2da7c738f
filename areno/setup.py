"""Build everything a training step needs (`Run`), in the order that surfaces
user mistakes first: run directory, tokenizer, data, reward plugin, then the
expensive parts (backend ranks, rollout engine). Closing a Run shuts down every
process it started, on every exit path."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import yaml

from areno.checkpoint import checkpoint_root, drop_after, latest_checkpoint, read_state, restore_controller_rng
from areno.config import TrainConfig
from areno.data import PromptSampler, PromptSet, RowSet, load_rows, normalize_rows, tokenize_prompts
from areno.errors import UserError
from areno.pack import Workspace
from areno.perf import default_micro_tokens
from areno.reporting import RunLogger
from areno.rewards import RewardScorer
from areno.rollout.engine import SamplingConfig
from areno.tasks import resolve_plugin_path

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
    scorer: RewardScorer
    backend: Any
    engine: Any
    logger: RunLogger
    world_size: int
    total_steps: int
    step: int = 0
    evalset: tuple[RowSet, PromptSet] | None = None
    workspace: Workspace = field(default_factory=Workspace)  # pack buffers reused every step
    max_tokens_per_micro: int = 8192  # --max-tokens-per-micro, or the device's default

    def maybe_eval(self, step: int, force: bool = False) -> None:
        cfg = self.cfg
        if self.evalset is None:
            return
        if not force and not (cfg.eval_interval and step % cfg.eval_interval == 0):
            return
        from areno.evaluate import evaluate

        # mean@k samples with a seed of its own per step, so a resumed run evaluates as
        # an uninterrupted one would (the engine's own stream is not checkpointed).
        sampling = replace(self.sampling, seed=EVAL_SEED_BASE + cfg.seed * 1_000_003 + step)
        m = evaluate(self.engine, self.tokenizer, self.scorer, *self.evalset, sampling,
                     k=cfg.eval_n)
        self.logger.log(step, m, advance=False)
        self.logger.info(f"eval step {step}: " + " ".join(
            f"{k.split('/', 1)[1]} {v:.3f}" for k, v in m.items() if k != "eval/prompts"))

    def maybe_save(self, step: int) -> None:
        cfg = self.cfg
        if not cfg.no_save and cfg.save_interval and step % cfg.save_interval == 0:
            self.save(step)

    def save(self, step: int) -> Path:
        from areno.checkpoint import save_checkpoint

        path = save_checkpoint(self, step)
        self.logger.info(f"saved checkpoint {path}")
        return path

    def finish(self) -> None:
        cfg = self.cfg
        if not (cfg.eval_interval and self.step % cfg.eval_interval == 0):
            self.maybe_eval(self.step, force=True)
        if not cfg.no_save and (not cfg.save_interval or self.step % cfg.save_interval != 0):
            self.save(self.step)
        self.logger.info(f"done: {self.step} steps; metrics in {self.logger.metrics_path}")


def resolve_device(cfg: TrainConfig) -> str:
    if cfg.device != "auto":
        if cfg.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UserError("--device cuda: no CUDA GPU is visible")
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_output_dir(cfg: TrainConfig, resume: Path | None = None) -> Path:
    if cfg.output_dir:
        out = Path(cfg.output_dir).expanduser()
    elif resume is not None and resume.parent.name == "checkpoints":
        out = resume.parent.parent  # the resumed run's own directory
    else:
        out = Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if resume is None and not cfg.eval_only and (out / "metrics.jsonl").is_file():
        raise UserError(f"--output-dir {out} already holds a run (metrics.jsonl): continue it "
                        "with --resume latest, or choose another --output-dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "config.yaml", "w") as f:
            yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    except OSError as e:
        raise UserError(f"--output-dir {out}: cannot write there ({e.strerror})") from None
    return out


def load_data(cfg: TrainConfig, tokenizer: Any) -> tuple[RowSet, PromptSet]:
    if cfg.dataset_path is None:
        from areno.tasks import arith

        rows = normalize_rows(arith.rows(), source="builtin:arith")
    else:
        rows = load_rows(cfg.dataset_path, split=cfg.dataset_split,
                         loader_fn=cfg.dataset_loader_fn, skip_bad_rows=cfg.skip_bad_rows)
    prompts = tokenize_prompts(rows, tokenizer, use_chat_template=cfg.chat_template,
                               system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len)
    return rows, prompts


def load_eval_data(cfg: TrainConfig, tokenizer: Any) -> tuple[RowSet, PromptSet]:
    rows = load_rows(cfg.eval_dataset_path, split=cfg.eval_split,
                     loader_fn=cfg.dataset_loader_fn, skip_bad_rows=cfg.skip_bad_rows)
    if cfg.eval_max_prompts:
        rows.rows[:] = rows.rows[: cfg.eval_max_prompts]
    prompts = tokenize_prompts(rows, tokenizer, use_chat_template=cfg.chat_template,
                               system_prompt=cfg.system_prompt, max_prompt_len=cfg.max_prompt_len)
    return rows, prompts


def model_path_for(cfg: TrainConfig) -> str:
    if cfg.ckpt is not None:
        return cfg.ckpt
    from areno.tiny import tiny_model_path

    return str(tiny_model_path("arith"))


def total_steps_for(cfg: TrainConfig, sampler: PromptSampler) -> int:
    by_epochs = cfg.epochs * sampler.batches_per_epoch
    return min(cfg.max_steps, by_epochs) if cfg.max_steps else by_epochs


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except OSError as e:
        raise UserError(f"--ckpt {model_path}: cannot load a tokenizer from it "
                        f"({' '.join(str(e).split())[:200]})") from None


def find_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume names (None without --resume)."""
    if cfg.resume is None:
        return None
    if cfg.resume != "latest":
        ckpt = Path(cfg.resume).expanduser()
        read_state(ckpt)  # UserError unless it is a complete checkpoint
        return ckpt
    if not cfg.save_path and not cfg.output_dir:
        raise UserError("--resume latest needs --output-dir (or --save-path) to look in")
    root = checkpoint_root(cfg, Path(cfg.output_dir or "."))
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise UserError(f"--resume latest: no complete checkpoint under {root}")
    return ckpt


@contextlib.contextmanager
def open_run(cfg: TrainConfig, engine: Any = None) -> Iterator[Run]:
    """Build a Run; everything started is stopped when the block exits.
    engine: a RolloutEngine to use instead of building one (benchmarks, tests)."""
    from areno.backend.controller import TorchBackend
    from areno.rollout.engine import make_engine

    device = resolve_device(cfg)
    resume = find_resume(cfg)
    state = read_state(resume) if resume else None
    out = make_output_dir(cfg, resume)
    if resume:
        # Checkpoints after the resumed one belong to the abandoned continuation
        # (like its metrics.jsonl lines): `--resume latest` must not pick them later.
        drop_after(checkpoint_root(cfg, out), int(state["step"]))
    base_model = state["model_path"] if state else model_path_for(cfg)
    model_path = str(resume) if resume else base_model
    tokenizer = load_tokenizer(model_path)
    if cfg.eval_only:
        rows, prompts = None, None
    else:
        rows, prompts = load_data(cfg, tokenizer)
    evalset = load_eval_data(cfg, tokenizer) if cfg.eval_dataset_path else None
    sampler = PromptSampler(len(prompts), cfg.batch_size, cfg.seed) if prompts else None
    if sampler and state:
        sampler.load_state_dict(state["sampler"])
    total = total_steps_for(cfg, sampler) if sampler else 0
    start = int(state["step"]) if state else 0
    world_size = cfg.world_size or _default_world_size(device)
    longest = max(int(p.lengths.max()) for p in (prompts, evalset and evalset[1]) if p)
    with contextlib.ExitStack() as stack:
        scorer = stack.enter_context(RewardScorer(
            resolve_plugin_path(cfg.reward_fn_path), workers=cfg.reward_workers,
            timeout=cfg.reward_timeout, on_error=cfg.on_reward_error))
        backend = None
        if not cfg.eval_only:
            backend = TorchBackend(backend_config(cfg, model_path, base_model, world_size,
                                                  device, total))
            stack.callback(backend.close)
            if resume:
                backend.load_state(resume / "backend")
        if engine is None:
            engine = make_engine(cfg.rollout_engine, model_path,
                                 **_engine_kwargs(cfg, device, longest))
            stack.callback(engine.shutdown)
        logger = stack.enter_context(RunLogger(out, total, cfg.report_to, config=cfg.to_dict(),
                                               start_step=start))
        what = "evaluating" if cfg.eval_only else (
            f"{len(prompts)} prompts ({prompts.dropped_overlong} overlong dropped"
            + (f", {rows.skipped} malformed rows skipped" if rows.skipped else "")
            + f"), {total} steps of {cfg.batch_size}x{cfg.n_samples}")
        logger.info(f"areno: {model_path} on {device} x{world_size}, {what}"
                    + (f", resumed at step {start}" if resume else "") + f"; run dir {out}")
        sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                  max_tokens=cfg.max_new_tokens)
        if resume:  # last: engine and backend start-up may reseed the global RNGs
            restore_controller_rng(resume)
        yield Run(cfg=cfg, output_dir=out, model_path=base_model, tokenizer=tokenizer, rows=rows,
                  prompts=prompts, sampler=sampler, sampling=sampling, scorer=scorer,
                  backend=backend, engine=engine, logger=logger, world_size=world_size,
                  total_steps=total, step=start, evalset=evalset,
                  max_tokens_per_micro=cfg.max_tokens_per_micro or default_micro_tokens(device))


def backend_config(cfg: TrainConfig, model_path: str, base_model: str, world_size: int,
                   device: str, total_steps: int) -> Any:
    from areno.backend.config import BackendConfig
    from areno.losses import LossConfig

    low, high = cfg.loss_eps()
    loss = LossConfig(algo=cfg.algo, clip_eps_low=low, clip_eps_high=high, kl_coef=cfg.kl_coef,
                      kl_type=cfg.kl_type, entropy_coef=cfg.entropy_coef, tis_cap=cfg.tis_cap)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return BackendConfig(
        model_path=model_path, world_size=world_size, device=device, dtype=dtype,
        strategy=cfg.strategy, lr=cfg.lr, weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps * cfg.mini_batches * cfg.ppo_epochs,
        min_lr_ratio=cfg.min_lr_ratio, max_grad_norm=cfg.max_grad_norm or None,
        grad_checkpointing=cfg.grad_checkpointing, ppo_epochs=cfg.ppo_epochs,
        recompute_logprobs=cfg.recompute_logprobs, loss=loss, max_nan_steps=cfg.max_nan_steps,
        seed=cfg.seed, ref_model_path=base_model,
    )


def _default_world_size(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return 1


def _engine_kwargs(cfg: TrainConfig, device: str, max_prompt_len: int) -> dict[str, Any]:
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    # At least 64: the weight-sync probe is scored as one prompt.
    kw: dict[str, Any] = dict(dtype=dtype, seed=cfg.seed,
                              max_model_len=max(max_prompt_len + cfg.max_new_tokens, 64))
    if cfg.rollout_engine == "vllm":
        kw["tensor_parallel_size"] = cfg.tensor_parallel_size
        if device == "cuda":
            kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kw["enable_sleep_mode"] = True
        else:
            kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    else:
        kw["device"] = device
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM logs several lines per weight push at INFO/WARNING; the step line is ours.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    return kw
