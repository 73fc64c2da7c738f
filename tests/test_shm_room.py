"""The run's /dev/shm footprint is checked before any rank starts (runtime/shm.py):
a small /dev/shm (docker's 64 MiB) is one line naming the sizes and the fix, not
an OSError traceback at the first segment that does not fit."""

from __future__ import annotations

import pytest

from areno.config.train import TrainConfig
from areno.errors import UserError
from areno.runtime import shm

SMOL_PARAMS = 134_515_008  # SmolLM2-135M
MIB = 1 << 20


def config(files, **kw) -> TrainConfig:
    return TrainConfig.from_sources(None, {**files, "batch_size": 4, "n_samples": 4, "max_new_tokens": 64,
                                           "max_prompt_len": 128, **kw})


def test_the_footprint_counts_k_plus_one_weight_slots_the_rollouts_in_flight_and_the_pack(files):
    parts = shm.shm_footprint(config(files, rollout_world_size=1, off_policy_steps=2), SMOL_PARAMS * 2, 0, 1)
    assert parts == {
        "3 weight slot(s) (--off-policy-steps 2: max(2, K + 1))": 3 * SMOL_PARAMS * 2,
        "3 rollout result segment(s)": int(3 * 16 * 64 * 8 * 1.25),
        "the pack": int(16 * (128 + 64) * 25 * 1.25),
    }
    k0 = shm.shm_footprint(config(files, rollout_world_size=1), SMOL_PARAMS * 2, 0, 1)
    assert k0["2 weight slot(s) (--off-policy-steps 0: max(2, K + 1))"] == 2 * SMOL_PARAMS * 2  # two at K = 0
    colocated = shm.shm_footprint(config(files), SMOL_PARAMS * 2, 0, 2)
    assert set(colocated) == {"1 rollout result segment(s)", "the pack"}  # weights stay in the ranks


def test_lora_adapter_dirs_count_for_every_vllm_engine_on_the_host(files):
    parts = shm.shm_footprint(config(files, lora_rank=8), SMOL_PARAMS * 2, 2_000_000, 4)
    assert parts["4 engine(s)' LoRA adapter dirs"] == 2 * 4 * 2_000_000  # old and new version at once
    assert not any("LoRA" in k for k in shm.shm_footprint(config(files, lora_rank=8, rollout_engine="hf"),
                                                          SMOL_PARAMS * 2, 2_000_000, 4))


def test_under_lora_the_weight_slots_hold_the_adapter_alone(files):
    """Engine processes keep the base from their start: a publish writes the adapter."""
    parts = shm.shm_footprint(config(files, lora_rank=8, rollout_world_size=1, off_policy_steps=1,
                                     rollout_engine="hf"), SMOL_PARAMS * 2, 2_000_000, 1)
    assert parts["2 weight slot(s) (--off-policy-steps 1: max(2, K + 1))"] == 2 * 2_000_000


def test_a_small_dev_shm_is_one_line_naming_the_sizes_and_the_fix(files, monkeypatch):
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 64 * MIB)
    cfg = config(files, rollout_world_size=1, off_policy_steps=1)
    with pytest.raises(UserError, match=r"/dev/shm has 64.0 MiB free, but this run needs about 513.\d MiB of "
                       r"shared memory \(2 weight slot\(s\) \(--off-policy-steps 1: max\(2, K \+ 1\)\) 513.1 MiB, .*\); "
                       r"enlarge it \(docker run --shm-size=2g\) or lower --off-policy-steps"):
        shm.check_shm_room(cfg, SMOL_PARAMS * 2, 0, 1)
    shm.check_shm_room(cfg, 10 * MIB, 0, 1)  # a small model fits
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: None)  # no /dev/shm to read: nothing to check
    shm.check_shm_room(cfg, SMOL_PARAMS * 2, 0, 1)


def test_the_cli_checks_it_before_any_rank_starts(tmp_path, monkeypatch, capsys, tiny_arith_path):
    import areno.backend.controller
    from areno.cli import main

    def must_not_start(*args, **kwargs):
        raise AssertionError("started before the shared-memory check")

    monkeypatch.setattr(areno.backend.controller, "TorchBackend", must_not_start)
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 1 * MIB)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rc = main(["train", "--ckpt", str(tiny_arith_path), "--dataset-path", str(data), "--device", "cpu",
               "--reward-fn-path", "builtin:arith", "--no-chat-template", "--batch-size", "64",
               "--n-samples", "16", "--max-new-tokens", "512", "--rollout-engine", "hf",
               "--reward-workers", "0", "--no-save", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("areno: error: /dev/shm has 1.0 MiB free") and "--shm-size=" in err[0], err


def test_a_cached_hub_id_counts_its_weights_and_a_partial_snapshot_counts_none(tiny_chat_path, tmp_path,
                                                                              monkeypatch):
    """`--ckpt org/name` (every README command): the footprint and the checkpoint
    room are estimated from its snapshot in the HF cache when it is there whole."""
    import shutil

    import huggingface_hub.constants

    from areno.models.directory import cached_weights, check_model_dir

    hub = tmp_path / "hub"
    for repo, files in (("whole", None), ("partial", ["config.json"])):
        snap = hub / f"models--areno-test--{repo}" / "snapshots" / "abc"
        if files is None:
            shutil.copytree(tiny_chat_path, snap)
        else:
            snap.mkdir(parents=True)
            for f in files:
                shutil.copy(tiny_chat_path / f, snap / f)
        (snap.parents[1] / "refs").mkdir()
        (snap.parents[1] / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    whole = cached_weights("areno-test/whole")
    assert whole is not None and whole == check_model_dir(tiny_chat_path, "--ckpt", "")
    assert cached_weights("areno-test/partial") is None and cached_weights("areno-test/absent") is None
