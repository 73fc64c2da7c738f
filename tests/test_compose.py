"""The features compose through the one scheduler: multi-turn environments under
split placement (K = 0 equal to colocated; K >= 1 with its lag and an exact
resume with trajectories in flight), dynamic sampling at K >= 1 (refills are
rounds under the same admission, resumed exactly), eval with an environment,
and the overlong punishment of a trajectory. Runs go through `areno.cli.main`
in this process (the ranks and engine processes are spawned as in any run)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from areno.cli import main
from test_async_loop import saved_steps
from test_demo_learns import STOP, assert_learned
from test_resume import DIGIT_REWARD, EVAL_ROWS, HF1, UNTIMED, train_steps

GUESS = str(Path(__file__).resolve().parents[1] / "examples" / "guess" / "env.py")
ENV = ["--env-path", GUESS, "--max-turns", "2", "--reward-workers", "0", "--lr", "1e-3"]
SPLIT = ["--rollout-world-size", "1"]
# Seconds, not computation: the engines' idle and generate time of a multi-turn round.
TIMED = (*UNTIMED, "env/engine_idle_s", "env/generate_s")


def train(out: Path, areno_cache: Path, monkeypatch, *args: str, steps: int = 4,
          base: tuple[str, ...] = tuple(HF1)) -> dict[int, dict]:
    """`areno train` in this process (base: HF1, or () for the demo's preset) -> step
    -> its training metrics."""
    monkeypatch.setenv("ARENO_CACHE", str(areno_cache))
    rc = main(["train", *base, "--max-steps", str(steps), "--seed", "0", "--output-dir", str(out), *args])
    assert rc in (0, None)
    return train_steps(out)


def assert_same(a: dict[int, dict], b: dict[int, dict], steps) -> None:
    """Every metric both runs computed is identical (the split run adds its lag and waits)."""
    for s in steps:
        keys = [k for k in a[s] if not k.startswith(TIMED)]
        assert set(keys) <= set(b[s]), set(keys) - set(b[s])
        for k in keys:
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])


@pytest.mark.slow  # full tier: test_dynsample's and test_lora_split's K = 0 twins hold split = colocated by default
def test_env_under_split_placement_at_k0_is_the_colocated_run_bit_for_bit(tmp_path, areno_cache, monkeypatch):
    """The engine process runs the episode driver beside its engine; with the turns
    schedule the trajectories, rewards and updates are the colocated run's."""
    colocated = train(tmp_path / "colocated", areno_cache, monkeypatch, *ENV)
    split = train(tmp_path / "split", areno_cache, monkeypatch, *ENV, *SPLIT)
    assert_same(colocated, split, range(1, 5))
    assert all(split[s]["rollout/policy_lag_max"] == 0 for s in split)
    assert colocated[4]["env/turns_mean"] > 1.0  # the env answered: multi-turn trajectories trained


def test_env_at_k1_lags_one_version_and_resumes_exactly_with_trajectories_in_flight(
        tmp_path, areno_cache, monkeypatch):
    k1 = [*ENV, *SPLIT, "--off-policy-steps", "1", "--whole-rounds"]  # exact resume
    full = train(tmp_path / "full", areno_cache, monkeypatch, *k1, "--save-interval", "3", "--keep-last", "0",
                 steps=6)
    assert [full[s]["rollout/policy_lag_max"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
    # Per-token behaviour log-probs: at lag 0 (step 1, fp32) the trainer's equal the
    # sampler's over the policy tokens (an observation token counted would not);
    # one version behind they differ.
    assert full[1]["offpolicy/kl"] < 1e-5 and all(full[s]["offpolicy/kl"] > 0 for s in range(2, 7))
    ckpt = tmp_path / "full" / "checkpoints" / "step_000003"
    assert saved_steps(ckpt) == [4, 5]  # two multi-turn rounds in flight, saved with their env rewards
    resumed = train(tmp_path / "resumed", areno_cache, monkeypatch, *k1, "--resume", str(ckpt), steps=6)
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):  # the saved rounds' env/* counts are not kept: what they trained on is
        resumed[s] |= {k: v for k, v in full[s].items() if k.startswith("env/")}
    assert_same(full, resumed, [4, 5, 6])


@pytest.mark.faults  # a second K = 1 resume (the env one above is the default tier's)
def test_dynamic_sampling_at_k1_refills_under_admission_and_resumes_exactly(tmp_path, areno_cache, monkeypatch):
    """A refill takes the next round in flight (or starts one): lag stays <= K,
    and a resume from a checkpoint with rounds in flight repeats the steps."""
    ds = [*SPLIT, "--off-policy-steps", "1", "--whole-rounds", "--dynamic-sampling", "reward",
          "--max-sampling-rounds", "3"]
    full = train(tmp_path / "full", areno_cache, monkeypatch, *ds, "--save-interval", "3", "--keep-last", "0",
                 steps=6)
    assert max(full[s]["rollout/policy_lag_max"] for s in full) <= 1
    assert sum(full[s]["sampling/rounds"] for s in full) > 6  # some steps refilled
    assert all(full[s]["sampling/groups_kept"] == 4 or full[s]["sampling/bound_hit"] for s in full)
    resumed = train(tmp_path / "resumed", areno_cache, monkeypatch, *ds, "--resume",
                    str(tmp_path / "full" / "checkpoints" / "step_000003"), steps=6)
    assert sorted(resumed) == [4, 5, 6]
    assert_same(full, resumed, [4, 5, 6])


def test_dynamic_sampling_under_partial_rollouts_takes_groups_until_kept_within_the_lag(
        tmp_path, areno_cache, monkeypatch):
    """--dynamic-sampling with --partial-rollouts (first_finished.next_groups):
    a step takes groups from any round in flight, first finished, until
    --batch-size informative ones are kept (or the bound): a refill takes the
    groups it lacks, not a whole round, so a step can consume a number of groups
    no whole-round take gives; every one kept trained, no token over lag K.
    The graded reward makes groups informative often but not always."""
    from slow_group import Steps

    plugin = tmp_path / "digit.py"
    plugin.write_text(DIGIT_REWARD)
    seen = Steps(monkeypatch)
    steps = train(tmp_path / "run", areno_cache, monkeypatch, *SPLIT, "--off-policy-steps", "1",
                  "--partial-rollouts", "--dynamic-sampling", "reward", "--max-sampling-rounds", "3",
                  "--reward-fn-path", str(plugin), "--no-save", steps=6)
    kept = {s: int(steps[s]["sampling/groups_kept"]) for s in steps}
    taken = {s: kept[s] + int(steps[s]["sampling/groups_dropped"]) for s in steps}
    assert sorted(seen.prompts) == sorted(steps)
    assert all(kept[s] == 4 or steps[s]["sampling/bound_hit"] for s in steps)
    assert all(len(seen.prompts[s]) == kept[s] for s in steps if kept[s])
    assert any(taken[s] > 4 for s in steps) and any(taken[s] % 4 for s in steps), taken
    assert max(max(steps[s]["rollout/token_lag_max"], steps[s]["rollout/policy_lag_max"]) for s in steps) <= 1


@pytest.mark.parametrize("partial", [["--whole-rounds"], ["--partial-rollouts"]], ids=["whole-rounds", "partial"])
def test_refills_past_what_admission_counted_sample_streams_of_their_own(tmp_path, areno_cache, monkeypatch,
                                                                          partial):
    """The demo's 0/1 reward on the untrained model leaves most groups
    uninformative: steps take up to three rounds' worth, more than the two in
    flight at K = 1, so later rounds are admitted with the tags of steps a round
    already sampled for (whole rounds: publish lowers them; by group: admission
    sees fewer rounds' worth than it started). Each round still samples with a
    seed of its own (a stream per batch of prompts drawn), and the step trains
    what it kept at the bound."""
    from areno.producers import Producer

    seeds, start = [], Producer.start

    def spied(producer, data, idx, n, sampling, *args, **kwargs):
        seeds.append(sampling.seed)
        return start(producer, data, idx, n, sampling, *args, **kwargs)
    monkeypatch.setattr(Producer, "start", spied)
    steps = train(tmp_path / "run", areno_cache, monkeypatch, *SPLIT, "--off-policy-steps", "1", *partial,
                  "--dynamic-sampling", "reward", "--max-sampling-rounds", "3", "--no-save", steps=4)
    assert sum(steps[s]["sampling/groups_kept"] + steps[s]["sampling/groups_dropped"] > 8 for s in steps) >= 2
    assert len(set(seeds)) == len(seeds) >= 8, seeds


@pytest.mark.parametrize("placement", [[], [*SPLIT, "--off-policy-steps", "1"]], ids=["colocated", "split-k1"])
def test_eval_with_an_environment_scores_greedy_trajectories(tmp_path, areno_cache, monkeypatch, placement):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in EVAL_ROWS))
    out = tmp_path / "run"
    train(out, areno_cache, monkeypatch, *ENV, *placement, "--eval-dataset-path", str(data),
          "--eval-interval", "2", "--overlong-buffer", "4", steps=2)
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "eval/pass@1" in x]
    assert [e["step"] for e in evals] == [0, 2]
    assert all(e["eval/prompts"] == len(EVAL_ROWS) and 0 <= e["eval/pass@1"] <= 1 for e in evals)


def test_the_overlong_punishment_of_a_trajectory_counts_its_length_against_its_budget():
    """--overlong-buffer under --env-path: a trajectory of L tokens (sampled and
    observation) with budget B and buffer W is punished by (L - (B - W)) / W x
    the penalty once it passes B - W, as a completion is against --max-new-tokens."""
    from areno.run import Run

    cfg = SimpleNamespace(env_path="env.py", max_new_tokens=8, max_turns=2, max_trajectory_tokens=20,
                          overlong_buffer=4, overlong_penalty=1.0)
    batch = SimpleNamespace(response_lengths=np.array([8, 16, 18, 20]))
    np.testing.assert_allclose(Run.shaping(SimpleNamespace(cfg=cfg), batch), [0, 0, -0.5, -1.0])
    cfg.env_path = None  # single-turn: against --max-new-tokens
    np.testing.assert_allclose(Run.shaping(SimpleNamespace(cfg=cfg), SimpleNamespace(
        response_lengths=np.array([4, 6, 8]))), [0, -0.5, -1.0])


def rewards_of(steps: dict[int, dict]) -> np.ndarray:
    return np.array([r["reward/mean"] for _, r in sorted(steps.items())])


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_the_guess_demo_masters_its_game_two_rounds_ahead_on_an_engine_process(tmp_path, areno_cache,
                                                                                monkeypatch):
    """examples/guess at K = 2 with split placement (its README command plus three
    flags, whole rounds, and --stop-at-reward). Measured at seed 0: 0.17 over the first 10 steps,
    0.98 over the last 20 of 200, the 20-step mean at 0.9 by step 103-108 (where
    the run stops; colocated K = 0: test_env_learns)."""
    steps = train(tmp_path / "guess", areno_cache, monkeypatch, *ENV, *SPLIT, "--off-policy-steps", "2",
                  "--whole-rounds", "--no-save", *STOP, steps=200, base=())
    assert_learned(rewards_of(steps), 200, early_bar=0.4, early=10)
    assert max(r["rollout/policy_lag_max"] for r in steps.values()) == 2
    assert steps[max(steps)]["env/turns_mean"] > 1.5  # it reads the env's answer on turn 2


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("partial", [["--whole-rounds"], ["--partial-rollouts"]], ids=["whole-rounds", "partial"])
def test_the_demo_masters_its_task_with_dynamic_sampling_two_rounds_ahead(tmp_path, areno_cache, monkeypatch,
                                                                          partial):
    """The embedded demo with --dynamic-sampling reward at K = 2 on an engine process,
    400 of its 600 steps (its cosine schedule ends at 400), held to the demo's
    bar on the reward of every generated sample (reward/mean is the kept groups',
    which leaves out the all-right ones by design; --stop-at-reward uses the former).
    Measured at seed 0 (each round its own seed): 0.06 over the first 20 steps,
    0.98 over the last 20 of 400, the 20-step mean at 0.9 by step 209 (where the
    run stops); 1123 rounds in 400 steps. With --partial-rollouts (groups taken
    as they finish): 0.07 -> 0.98, 0.9 by step 196, 1167 rounds' worth."""
    steps = train(tmp_path / "demo", areno_cache, monkeypatch, *SPLIT, "--off-policy-steps", "2", *partial,
                  "--dynamic-sampling", "reward", "--no-save", *STOP, steps=400, base=())
    generated = np.array([r["sampling/reward_generated"] for _, r in sorted(steps.items())])
    # Most steps take two or three rounds, so rounds in flight are taken a step after
    # they start: measured lag 1 (0 at step 1), never over K.
    assert 1 <= max(r["rollout/policy_lag_max"] for r in steps.values()) <= 2
    assert sum(r["sampling/rounds"] for r in steps.values()) > len(steps)  # refills ran under admission
    assert_learned(generated, 400)
