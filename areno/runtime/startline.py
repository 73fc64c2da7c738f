"""The run's first lines: what it trains, where and on what engines (a fallback
said), resumed or not, its run dir; LoRA's parameter counts."""

from __future__ import annotations

from typing import Any

from areno import settings
from areno.rundir.resume import Resume
from areno.rundir.reporting import limit_note


def steps_text(n: int) -> str:
    """'1 step', '2 steps'."""
    return f"{n} step{'' if n == 1 else 's'}"


def start_line(run: Any, resume: Resume, device: str) -> str:
    """The run's first line: the policy, where it trains, on what, and the run dir."""
    cfg, prompts = run.cfg, run.prompts
    what = "evaluating" if cfg.eval_only else (
        f"{len(prompts)} prompts ({prompts.dropped_overlong} overlong dropped"
        + (f", {run.rows.skipped} malformed rows skipped" if run.rows.skipped else "")
        + f"), {steps_text(run.total_steps)} of {cfg.batch_size}x{cfg.n_samples}"
        + (f" ({note})" if (note := limit_note(run.total_steps, cfg.max_steps, cfg.epochs, len(prompts),
                                               cfg.batch_size)) else ""))
    model_path = str(resume.ckpt) if resume.ckpt else run.model_path
    return (f"areno: {model_path} on {device} x{run.world_size}, {what}"
            + (f", resumed at step {run.step}" if resume.ckpt else "")
            + fallback_note(cfg.rollout_engine, getattr(run.engine, "kinds", ()))
            + "".join(f"; {note}" for note in getattr(run.engine, "notes", ()))
            + settings.old_logprobs_note(cfg, device)
            + f"; run dir {run.output_dir}")


def fallback_note(asked: str | None, built: Any) -> str:
    """'; sampling with hf: ...' when the default engine fell back (asked None: the
    default, vllm; built: the kinds the engines report), else ''. Only the
    default falls back (rollout.factory.make_engine)."""
    if asked is not None or "hf" not in built:
        return ""
    return ("; sampling with the hf engine: vLLM does not import here (fell back; "
            "--rollout-engine hf says so, --rollout-engine vllm makes it an error)")


def lora_line(lora: Any, params: dict) -> str:
    """The LoRA run's parameter counts, one line."""
    t, n = params["trainable"], params["total"]
    return (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {', '.join(lora.target_modules)}: "
            f"{t:,} trainable of {n:,} parameters ({100 * t / n:.2f}%)"
            + (f"; adapter from {lora.adapter_path}" if lora.adapter_path else ""))
