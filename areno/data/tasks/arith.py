"""The embedded demo task: one-digit addition, `a+b=` with a+b < 10 (55 prompts).

Reward, dense enough that a random policy over a ~17-token vocabulary sometimes
succeeds and GRPO can climb (DESIGN.md, "embedded default"):
  1.0  the right digit, then end of sequence
  0.5  the right digit, then anything else
  0.0  otherwise
"""

from __future__ import annotations

from typing import Any


def rows() -> list[dict]:
    """The 55 prompts as normalized dataset rows."""
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)}
        for a in range(10)
        for b in range(10)
        if a + b < 10
    ]


def reward_fn(record) -> float:
    text = record.completion.strip()
    if not text or text[0] != record.answer:
        return 0.0
    return 1.0 if len(text) == 1 and record.finish_reason == "stop" else 0.5


# Embedded demo: hyper-parameters measured to make reward rise within minutes on
# 2 CPU cores (see DESIGN.md, "embedded default"); TrainConfig applies them when
# neither --ckpt nor --dataset-path is given.
DEMO_PRESET: dict[str, Any] = {
    "reward_fn_path": "builtin:arith",
    "chat_template": False,
    "lr": 3e-4,
    "max_new_tokens": 3,
    "batch_size": 16,
    "n_samples": 8,
    # 600 steps (with the cosine decay over them): the 20-step mean reward passes 0.9
    # near step 250 and ends near 0.98 (seeds 0-2; README); 400 ended at 0.91 (seed 0).
    "max_steps": 600,
    "epochs": 1000,  # 55 prompts make 3 batches an epoch: --max-steps bounds the demo
    "warmup_steps": 0,
    "min_lr_ratio": 0.1,
    "reward_workers": 0,
    # transformers' generate: for a 2-layer model vLLM's fixed CPU costs per step
    # (scheduling, re-packing the weights on every sync) and its ~15 s start-up
    # outweigh the model's compute (docs/PERFORMANCE.md, "The demo's step").
    "rollout_engine": "hf",
    "max_prompt_len": 16,
    "kv_cache_gb": 0.25,
}

# The demo with --lora-rank > 0, over DEMO_PRESET (issue 26, 3). The tiny model's
# final norm and lm_head are random-init and frozen under LoRA, which caps adapters
# of the decoder linears at an expected reward of 0.31 (scripts/lora_capacity.py);
# an adapter on its untied lm_head lifts the cap (0.998 fitted), and both engines
# serve it exactly. alpha and lr, measured on the demo at rank 8, seed 0, 400-600
# steps (docs/PERFORMANCE.md, "LoRA: does it learn?"): a large alpha and a small lr
# (A moves slowly, B·scaling fast) learn; alpha 16 at 3e-3 ends near 0.3, 5e-3 and
# 1e-2 collapse; alpha 64 / 1e-3 0.51, 128 / 5e-4 0.81 (400 steps), 256 / 2.5e-4
# 0.82 (600), 512 / 1.25e-4 0.46, 256 / 5e-4 collapses.
DEMO_LORA_PRESET: dict[str, Any] = {
    "lora_target_modules": "all-linear,lm_head",
    "lora_alpha": 256.0,
    "lr": 2.5e-4,
}


def demo_lora_preset(dropout: float) -> dict[str, Any]:
    """DEMO_LORA_PRESET for a run with this --lora-dropout: lm_head's adapter trains
    without dropout (config.lora refuses the two together), so with dropout the
    demo adapts the decoder linears only."""
    if dropout > 0:
        return {k: v for k, v in DEMO_LORA_PRESET.items() if k != "lora_target_modules"}
    return dict(DEMO_LORA_PRESET)
