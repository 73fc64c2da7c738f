"""--off-policy-steps and --rollout-world-size (issue 20): the rules between them
and the loss (areno/config/offpolicy.py), each refusal one line with exit 2 and no
traceback; what K >= 1 turns on; K = 0 changing nothing; what a resume may
change."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from areno.config import offpolicy
from areno.backend.config import BackendConfig
from helpers import refused
from areno.config.train import TrainConfig
from areno.errors import UserError
from areno.losses import LossConfig
from areno.config.resume import MAY_CHANGE, resume_config
from areno.settings import backend_config, engine_spec, sampling

ASYNC = ["--off-policy-steps", "1", "--rollout-world-size", "2"]


BAD = [
    (["--off-policy-steps", "1"], "--off-policy-steps 1 needs --rollout-world-size >= 1: colocated "
     "engines share the training GPUs and sleep while the ranks train, so rollouts cannot overlap"),
    (["--rollout-world-size", "3", "--tensor-parallel-size", "2"],
     "--rollout-world-size 3 with --tensor-parallel-size 2: an engine process holds one device"),
    ([*ASYNC, "--tensor-parallel-size", "4"],
     "--rollout-world-size 2 with --tensor-parallel-size 4: an engine process holds one device"),
    (["--off-policy-steps", "-1"], "--off-policy-steps must be >= 0"),
    (["--rollout-world-size", "-2"], "--rollout-world-size must be >= 0"),
    (["--off-policy-steps", "1.5"], "--off-policy-steps"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_each_refusal_is_one_line_exit_2(args, needle, capsys):
    assert needle in refused(args, capsys)


def test_lora_takes_engine_processes_and_any_k_and_still_refuses_tensor_parallel_engines(files, capsys):
    """The engine processes serve the adapter (test_lora_split.py); only LoRA's
    physical limit stays: whole-tensor adapter checks, so no TP engine."""
    for k in (0, 1, 3):
        cfg = TrainConfig.from_sources(None, {**files, "lora_rank": 8, "rollout_world_size": 2,
                                              "off_policy_steps": k})
        assert (cfg.lora_rank, cfg.rollout_world_size, cfg.off_policy_steps) == (8, 2, k)
    assert "--tensor-parallel-size" in refused(["--lora-rank", "8", "--tensor-parallel-size", "2"], capsys)


def test_recompute_turned_off_in_the_config_file_is_refused(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"off_policy_steps": 1, "rollout_world_size": 1,
                                 "optimization": {"recompute_logprobs": False}}))
    line = refused(["--config", str(f)], capsys)  # the switch has no --no- form: only --config says it
    assert "--off-policy-steps 1 needs --recompute-logprobs" in line
    assert "drop recompute_logprobs: false from --config" in line


def test_truncated_sampling_is_taken_under_k_since_both_engines_report_processed_logprobs(files, capsys):
    """The log-probs are those of the top-k / top-p distribution sampled from
    (tests/test_engine_contract.py, test_logprobs_match_transformers_forward), so
    decoupled PPO's behaviour policy is right with either engine."""
    for engine in ("vllm", "hf", None):
        cfg = TrainConfig.from_sources(None, {**files, "off_policy_steps": 1, "rollout_world_size": 1,
                                              "rollout_engine": engine, "top_p": 0.9, "top_k": 20})
        assert (cfg.top_p, cfg.top_k) == (0.9, 20)
        offpolicy.check_off_policy(cfg)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_any_staleness_bound_is_taken_with_its_defaults(k, files, capsys):
    """K >= 2 was refused while the loop kept one rollout ahead (issue 27)."""
    cfg = TrainConfig.from_sources(None, {**files, "off_policy_steps": k, "rollout_world_size": 1})
    offpolicy.check_off_policy(cfg)
    assert cfg.off_policy_steps == k and cfg.recompute_logprobs and cfg.tis_cap == offpolicy.OFF_POLICY_TIS_CAP
    assert f"--off-policy-steps {k} turns on --recompute-logprobs" in capsys.readouterr().out
    with pytest.raises(UserError, match=f"--off-policy-steps {k} needs --rollout-world-size"):
        offpolicy.check_off_policy(dataclasses.replace(cfg, rollout_world_size=0))


def test_k_turns_on_recompute_and_the_default_cap_and_says_so(files, capsys):
    cfg = TrainConfig.from_sources(None, {**files, "off_policy_steps": 1, "rollout_world_size": 2})
    assert cfg.recompute_logprobs is True and cfg.tis_cap == offpolicy.OFF_POLICY_TIS_CAP == 2.0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(
        "areno: --off-policy-steps 1 turns on --recompute-logprobs and --tis-cap 2 (decoupled PPO")
    bc = backend_config(cfg, "m", "m", 1, "cpu", 10, engine_spec(cfg, "cpu", 8))  # M > 0 needs an engine
    assert bc.recompute_logprobs and bc.loss.tis_cap == 2.0


def test_k_keeps_a_given_cap_and_a_given_recompute_silently(files, capsys):
    given = {**files, "off_policy_steps": 1, "rollout_world_size": 1, "tis_cap": 3.5, "partial_rollouts": False}
    cfg = TrainConfig.from_sources(None, given)
    assert cfg.tis_cap == 3.5 and cfg.recompute_logprobs
    assert capsys.readouterr().out.strip() == (
        "areno: --off-policy-steps 1 turns on --recompute-logprobs (decoupled PPO: the trainer's "
        "log-probs are the proximal policy, capped importance weights correct for the stale sampler)")
    cfg = TrainConfig.from_sources(None, {**given, "recompute_logprobs": True})
    assert cfg.tis_cap == 3.5 and capsys.readouterr().out == ""


def test_config_yaml_records_what_k_turned_on(files, tmp_path, capsys):
    from areno.run import make_output_dir

    cfg = TrainConfig.from_sources(None, {**files, "off_policy_steps": 1, "rollout_world_size": 1,
                                          "output_dir": str(tmp_path / "r")})
    saved = yaml.safe_load((make_output_dir(cfg) / "config.yaml").read_text())
    assert (saved["off_policy_steps"], saved["rollout_world_size"]) == (1, 1)
    assert saved["recompute_logprobs"] is True and saved["tis_cap"] == 2.0 and saved["partial_rollouts"] is True


def test_k0_leaves_every_setting_as_it_was(files, capsys):
    """The defaults are K = 0, M = 0, and they change nothing: the same TrainConfig
    as not giving them, no line printed, and the backend, loss, engine and
    sampling settings of today's defaults."""
    plain = TrainConfig.from_sources(None, files)
    zero = TrainConfig.from_sources(None, {**files, "off_policy_steps": 0, "rollout_world_size": 0})
    assert (plain.off_policy_steps, plain.rollout_world_size) == (0, 0)
    assert zero == plain and capsys.readouterr().out == ""
    assert plain.recompute_logprobs is None and plain.tis_cap is None  # auto: off in fp32 (settings)
    bc = backend_config(zero, "m", "m", 2, "cpu", 10)
    assert bc == backend_config(plain, "m", "m", 2, "cpu", 10)
    assert bc.loss == LossConfig()  # grpo, eps 0.2/0.2, no KL, entropy, TIS or dual-clip
    assert bc.recompute_logprobs is False
    assert bc == BackendConfig(
        model_path="m", world_size=2, device="cpu", dtype="float32", strategy="auto", lr=1e-6,
        weight_decay=0.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.1, max_grad_norm=1.0,
        grad_checkpointing=False, ppo_epochs=1, recompute_logprobs=False, loss=LossConfig(),
        max_nan_steps=3, seed=0, ref_model_path="m", engine=None, cpu_threads=None,
        heartbeat_timeout_s=0.0)
    assert engine_spec(zero, "cpu", 64) == engine_spec(plain, "cpu", 64)
    assert sampling(zero) == sampling(plain)
    # the demo too
    assert TrainConfig.from_sources(None, {"off_policy_steps": 0}) == TrainConfig.from_sources(None, {})


def test_help_lists_the_options_and_the_cap_default():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "areno.cli", "train", "--help"],
                         capture_output=True, text=True, env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out.stdout).split())  # rich's panel borders
    for flag in ("--off-policy-steps", "--rollout-world-size", "--recompute-logprobs"):
        assert flag in text, flag
    assert "off in fp32; 2 in bf16/fp16 or with --off-policy-steps >= 1" in text  # --tis-cap
    assert "auto: on in bf16/fp16 or with --off-policy-steps >= 1, off in fp32" in text  # --recompute-logprobs


# -- resume ---------------------------------------------------------------------
def test_resume_may_change_m_but_not_k(tmp_path, capsys):
    from test_resume_changes import saved_run

    saved_run(tmp_path, off_policy_steps=1, rollout_world_size=2, max_steps=2)
    assert "rollout_world_size" in MAY_CHANGE and "off_policy_steps" not in MAY_CHANGE
    capsys.readouterr()
    given = {"resume": "latest", "output_dir": str(tmp_path), "rollout_world_size": 4}
    cfg = resume_config(TrainConfig.from_sources(None, given), set(given))
    # the checkpoint's K and what it turned on, the new M
    assert (cfg.off_policy_steps, cfg.rollout_world_size) == (1, 4)
    assert cfg.recompute_logprobs and cfg.tis_cap == 2.0
    assert capsys.readouterr().out.strip() == "areno: resuming with --rollout-world-size 2 -> 4"

    # the same K again, without the M and what K turned on: the checkpoint's, nothing printed
    same = {"resume": "latest", "output_dir": str(tmp_path), "off_policy_steps": 1}
    cfg = resume_config(TrainConfig.from_sources(None, same), set(same))
    assert (cfg.off_policy_steps, cfg.rollout_world_size, cfg.tis_cap) == (1, 2, 2.0)
    assert capsys.readouterr().out == ""

    bad = {"resume": "latest", "output_dir": str(tmp_path), "off_policy_steps": 3}
    with pytest.raises(UserError, match=r"^--resume: --off-policy-steps 1 -> 3: this option cannot "
                                        "change when resuming"):
        resume_config(TrainConfig.from_sources(None, bad), set(bad))
    # M may change, but not to a placement K cannot run on
    zero_m = {"resume": "latest", "output_dir": str(tmp_path), "rollout_world_size": 0}
    with pytest.raises(UserError, match="--off-policy-steps 1 needs --rollout-world-size >= 1"):
        resume_config(TrainConfig.from_sources(None, zero_m), set(zero_m))


def test_a_synchronous_run_cannot_resume_asynchronous(tmp_path):
    from test_resume_changes import saved_run

    saved_run(tmp_path, max_steps=2)
    given = {"resume": "latest", "output_dir": str(tmp_path), "off_policy_steps": 1,
             "rollout_world_size": 1}
    with pytest.raises(UserError, match=r"^--resume: --off-policy-steps 0 -> 1: this option cannot"):
        resume_config(TrainConfig.from_sources(None, given), set(given))


@pytest.mark.parametrize("given, device, want", [
    ({}, "cpu", (False, None)),                                   # fp32: the sampler's agree to ~1e-5
    ({}, "cuda", (True, 2.0)),                                    # --dtype auto is bf16 on a GPU
    ({"dtype": "bfloat16"}, "cpu", (True, 2.0)),
    ({"dtype": "bfloat16", "recompute_logprobs": False}, "cpu", (False, None)),  # --config's opt-out
    ({"dtype": "bfloat16", "tis_cap": 3.0}, "cpu", (True, 3.0)),
    ({"tis_cap": 3.0}, "cpu", (True, 3.0)),                       # a cap needs the trainer's
    ({"recompute_logprobs": True}, "cpu", (True, None)),          # as before: no weight unless asked
])
def test_old_logprobs_default_to_the_trainers_in_half_precision(files, given, device, want):
    from areno.settings import old_logprobs, old_logprobs_note

    cfg = TrainConfig.from_sources(None, {**files, **given})
    assert old_logprobs(cfg, device) == want
    bc = backend_config(cfg, "m", "m", 1, device, 10)
    assert (bc.recompute_logprobs, bc.loss.tis_cap) == want
    note = old_logprobs_note(cfg, device)
    assert bool(note) == (want[0] and cfg.recompute_logprobs is None)
    if note:
        assert note == ("; old log-probs: the trainer's (its own, detached), the sampler's mismatch a "
                        f"truncated-IS weight (--tis-cap {want[1]:g})")


def test_a_tis_cap_with_the_samplers_old_logprobs_is_refused(files):
    """--tis-cap weighs trainer/sampler: with recompute_logprobs: false (--config's
    opt-out) there is no trainer side; unset, the cap turns the trainer's on."""
    with pytest.raises(UserError, match="--tis-cap needs --recompute-logprobs"):
        TrainConfig.from_sources(None, {**files, "tis_cap": 2.0, "recompute_logprobs": False})
    assert TrainConfig.from_sources(None, {**files, "tis_cap": 2.0}).recompute_logprobs is None
