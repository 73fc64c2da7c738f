"""Defaults that depend on other options, and how they are recorded: the
--algo-dependent --loss-agg, dual-clip's --clip-ratio-c."""

import pytest
import yaml

from areno.cli import main
from areno.config.train import TrainConfig


@pytest.mark.parametrize("algo,want", [("grpo", "token-mean"), ("gspo", "seq-mean-token-mean")])
def test_loss_agg_default_follows_algo(files, algo, want):
    assert TrainConfig.from_sources(None, {**files, "algo": algo}).loss_agg == want
    assert TrainConfig(algo=algo).loss_agg == want


def test_explicit_loss_agg_wins_from_a_flag_or_yaml(files, tmp_path):
    cfg = TrainConfig.from_sources(None, {**files, "algo": "gspo", "loss_agg": "token-mean"})
    assert cfg.loss_agg == "token-mean"
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"algorithm": {"algo": "gspo", "loss_agg": "seq-mean-token-sum-norm"}}))
    assert TrainConfig.from_sources(str(f), files).loss_agg == "seq-mean-token-sum-norm"


def test_config_yaml_records_the_loss_agg_used(files, tmp_path):
    from areno.run import make_output_dir

    cfg = TrainConfig.from_sources(None, {**files, "algo": "gspo", "output_dir": str(tmp_path / "r")})
    out = make_output_dir(cfg)
    assert yaml.safe_load((out / "config.yaml").read_text())["loss_agg"] == "seq-mean-token-mean"


def test_clip_ratio_c_is_off_by_default_and_reaches_the_loss(files):
    from areno.settings import backend_config

    cfg = TrainConfig.from_sources(None, files)
    assert cfg.clip_ratio_c is None
    assert backend_config(cfg, "m", "m", 1, "cpu", 10).loss.clip_ratio_c is None
    cfg = TrainConfig.from_sources(None, {**files, "clip_ratio_c": 3.0})
    assert backend_config(cfg, "m", "m", 1, "cpu", 10).loss.clip_ratio_c == 3.0


def test_cpu_threads_reach_the_ranks_unset_by_default(files):
    """Unset: each rank picks rank_cpu_threads (tests/test_backend_procs.py checks it)."""
    from areno.settings import backend_config

    cfg = TrainConfig.from_sources(None, files)
    assert backend_config(cfg, "m", "m", 1, "cpu", 10).cpu_threads is None
    cfg = TrainConfig.from_sources(None, {**files, "cpu_threads": 2})
    assert backend_config(cfg, "m", "m", 1, "cpu", 10).cpu_threads == 2


@pytest.mark.parametrize("k", [0, 1])
def test_at_k1_the_cores_are_split_among_the_ranks_and_the_engine_processes(files, k):
    """Engine processes that generate while the ranks train share the cores with
    them (settings.cpu_threads); at K = 0 they take turns and each picks its own
    share; on GPU and under --cpu-threads nothing changes."""
    import os

    from areno.procs.device import rank_cpu_threads
    from areno.settings import backend_config, engine_spec

    def threads(extra: dict, device: str = "cpu") -> int | None:
        cfg = TrainConfig.from_sources(None, {**files, "rollout_world_size": 1, "off_policy_steps": k, **extra})
        return backend_config(cfg, "m", "m", 1, device, 10, engine=engine_spec(cfg, device, 64)).cpu_threads

    assert threads({}) == (rank_cpu_threads(len(os.sched_getaffinity(0)), 2) if k else None)
    assert threads({}, "cuda") is None and threads({"cpu_threads": 3}) == 3


def test_the_timeouts_are_options_whose_defaults_fit_a_cold_multi_gpu_start(files):
    from areno.settings import backend_config

    be = backend_config(TrainConfig.from_sources(None, files), "m", "m", 1, "cpu", 10)
    assert (be.startup_timeout_s, be.command_timeout_s, be.collective_timeout_s) == (1800, 3600, 1800)
    given = {"startup_timeout": 60, "command_timeout": 70, "collective_timeout": 80}
    be = backend_config(TrainConfig.from_sources(None, {**files, **given}), "m", "m", 1, "cpu", 10)
    assert (be.startup_timeout_s, be.command_timeout_s, be.collective_timeout_s) == (60, 70, 80)


@pytest.mark.parametrize("value", ["1", "0.5"])
def test_clip_ratio_c_must_exceed_one(value, capsys):
    assert main(["train", "--clip-ratio-c", value]) == 2
    err = capsys.readouterr().err
    assert "--clip-ratio-c must be > 1.0" in err and len(err.strip().splitlines()) == 1


def test_config_choices_match_the_modules_that_dispatch_on_them():
    """Each flag offers exactly the choices of the module that dispatches on them (config.py
    names the owners' Literals; those of torch-side owners live in areno/choices.py)."""
    import typing

    from areno.advantages import ADVANTAGE_MODES
    from areno.config.train import LOSS_AGG_BY_ALGO, field_type
    from areno.losses import ALGOS, KL_TYPES
    from areno.split import LOSS_AGG_MODES

    for name, owner in (("algo", ALGOS), ("kl_type", KL_TYPES), ("adv_mode", ADVANTAGE_MODES),
                        ("loss_agg", LOSS_AGG_MODES)):
        assert typing.get_args(field_type(name)) == owner, name
    assert set(LOSS_AGG_BY_ALGO) == set(ALGOS) and set(LOSS_AGG_BY_ALGO.values()) <= set(LOSS_AGG_MODES)
