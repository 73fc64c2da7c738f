"""LoRA under split placement (--lora-rank with --rollout-world-size): the
engine processes start from the base model and get only the adapter, checked
as a colocated rank's engine is (the backend side: test_split_placement.py).
Here, through the CLI: K = 0 repeats the colocated LoRA run step for step, a
K = 1 run resumes exactly from an adapter checkpoint, and the LoRA demo learns."""

from __future__ import annotations

import numpy as np
import pytest

from test_async_loop import K1, saved_steps
from inprocess import run_here
from test_resume import assert_same_steps, ok, train_steps

LORA = ["--lora-rank", "8", "--batch-size", "4", "--n-samples", "4", "--rollout-engine", "hf",
        "--world-size", "1", "--seed", "0"]
KEYS = ("reward/", "train/", "response/", "data/prompt_hash", "offpolicy/")


def lora_run(out, areno_cache, *extra: str, steps: int = 4) -> dict[int, dict]:
    ok(run_here(["train", *LORA, "--max-steps", str(steps), "--output-dir", str(out), *extra], areno_cache))
    return train_steps(out)


def test_at_k0_an_engine_process_repeats_the_colocated_lora_run_and_resumes_it(tmp_path, areno_cache):
    """Seeded, K = 0: with its engine in a process of its own (the adapter through
    shared memory), the LoRA run samples, scores and trains as the colocated one,
    bit for bit: the same engine code serves the same adapter on the same base
    with the same per-engine seeds. A load that left the engine on the base or
    on an older adapter would diverge from step 2. Resumed from step 2's adapter
    checkpoint, the engine process starts from the base and must get that
    adapter before step 3's rollout (K = 0 samples it again): steps 3 and 4
    repeat."""
    colocated = lora_run(tmp_path / "colocated", areno_cache, "--no-save")
    split = lora_run(tmp_path / "split", areno_cache, "--rollout-world-size", "1", "--save-interval", "2",
                     "--keep-last", "0")
    assert sorted(split) == [1, 2, 3, 4] and all("train/loss" in r for r in split.values())
    assert {s: {k: v for k, v in r.items() if k.startswith(KEYS)} for s, r in split.items()} == \
        {s: {k: v for k, v in r.items() if k.startswith(KEYS)} for s, r in colocated.items()}
    ckpt = tmp_path / "split" / "checkpoints" / "step_000002"
    resumed = lora_run(tmp_path / "resumed", areno_cache, "--rollout-world-size", "1", "--no-save",
                       "--resume", str(ckpt))
    assert sorted(resumed) == [3, 4]
    assert_same_steps(split, resumed, [3, 4])


@pytest.mark.faults  # K = 0 (above) proves the adapter path in the default tier; K = 1 resumes in this one
def test_at_k1_a_lora_run_lags_one_version_and_resumes_exactly(tmp_path, areno_cache):
    """The checkpoint is an adapter over the base with two rollouts in flight; the
    resumed run's engine process starts from the base and gets the checkpoint's
    adapter, the ranks train the saved rollouts as the uninterrupted run did, and
    the adapters published after the resume serve as before."""
    full = lora_run(tmp_path / "full", areno_cache, *K1, "--save-interval", "3", "--keep-last", "0", steps=6)
    assert [full[s]["rollout/policy_lag_max"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    assert all(full[s]["offpolicy/kl"] > 0 for s in range(2, 7))  # the sampler is one adapter behind
    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    assert saved_steps(ckpt) == [4, 5]
    # Steps 4 and 5 train the saved rollouts; step 6's is sampled after the resume,
    # with the adapter published after step 4's update.
    resumed = lora_run(tmp_path / "resumed", areno_cache, *K1, "--resume", str(ckpt), steps=6)
    assert sorted(resumed) == [4, 5, 6]
    assert_same_steps(full, resumed, [4, 5, 6])  # lag, log-probs, rewards, losses: all the same


@pytest.mark.learning
def test_the_lora_demo_learns_with_k1_and_an_engine_process(tmp_path, areno_cache):
    """`areno train --lora-rank 8` (the demo's LoRA preset) with its engine in a
    process of its own, one rollout ahead, for half the demo's steps, held to the
    bar of the colocated LoRA demo (test_lora.test_lora_demo_learns). Measured
    (CPU fp32, seed 0): mean reward of the first 20 steps 0.058, of steps 281-300
    0.608 (colocated, the same run: 0.061 -> 0.553); --stop-at-reward LEARN_LATE
    ends the run at step 137 (colocated: 132)."""
    from test_demo_learns import assert_learned
    from test_lora import LEARN_LATE, LEARN_STEPS

    out = tmp_path / "demo"
    ok(run_here(["train", "--lora-rank", "8", *K1, "--seed", "0", "--max-steps", str(LEARN_STEPS), "--no-save",
                 "--stop-at-reward", str(LEARN_LATE), "--output-dir", str(out)], areno_cache))
    rewards = np.array([r["reward/mean"] for _, r in sorted(train_steps(out).items())])
    assert_learned(rewards, LEARN_STEPS, LEARN_LATE)
