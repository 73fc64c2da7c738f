"""Backend pieces that run in the test process: chunked log-probs, packed
attention, the shared-memory hand-off, the LR schedule, and one rank's train
step (sync count, NaN handling) with a world-size-1 gloo group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import list_segments, random_batch
from rank_test_hooks import full_state

from areno.backend.attention import hf_name, register
from areno.backend.config import BackendConfig
from areno.backend.controller import free_port
from areno.backend.handoff import LocalPack, PackWriter
from areno.backend.model import (
    PolicyModule,
    chunked_logprobs,
    resolve_attn_implementation,
)
from areno.backend.step import NonFiniteStepsError, lr_lambda
from areno.losses import LossConfig
from areno.metrics import REPORTED
from areno.pack import build_padded_pack, build_train_pack
from areno.rollout.factory import EngineSpec
from areno.split import build_split_pack

VOCAB = 300  # < the tiny chat model's vocabulary


def make_split(world_size: int, seed: int = 1, num_minibatches: int = 2, max_tokens: int = 64,
               nan_adv: bool = False):
    b = random_batch(seed=seed, num_prompts=8, vocab=VOCAB, max_response=20)
    adv = np.random.default_rng(seed).standard_normal(b.num_responses).astype(np.float32)
    if nan_adv:
        adv[:] = np.nan
    return build_split_pack(b, adv, world_size=world_size, max_tokens=max_tokens,
                            num_minibatches=num_minibatches)


# -- log-probs ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_logprobs_equal_full_log_softmax_values_and_grads(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 19, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (2, 19), generator=g)
    lp, ent = chunked_logprobs(h, w, t, chunk)
    ls = torch.log_softmax((h @ w.T), -1)
    lp_ref = ls.gather(-1, t[..., None])[..., 0]
    ent_ref = -(ls.exp() * ls).sum(-1)
    torch.testing.assert_close(lp.double(), lp_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, atol=1e-5, rtol=1e-5)
    a, b = torch.randn(2, 19, generator=g, dtype=torch.float64), torch.randn(2, 19, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((lp.double() * a + ent.double() * b).sum(), [h, w])
    want = torch.autograd.grad((lp_ref * a + ent_ref * b).sum(), [h, w])
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    # log-prob only (entropy unused): its grad arrives as None
    lp, _ = chunked_logprobs(h, w, t, chunk)
    got = torch.autograd.grad((lp.double() * a).sum(), [h, w])
    want = torch.autograd.grad((torch.log_softmax(h @ w.T, -1).gather(-1, t[..., None])[..., 0] * a).sum(), [h, w])
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def policy_module(tiny_chat_path, impl: str) -> PolicyModule:
    from transformers import AutoModelForCausalLM

    register()
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_path, dtype=torch.float32, attn_implementation=hf_name(impl))
    return PolicyModule(hf, chunk_size=13).eval()


def _packed_padded_alone(policy: PolicyModule, pass_cu: bool = True):
    """(packed lp, ent), (padded lp, ent at real positions), each sequence alone."""
    b = random_batch(seed=3, vocab=VOCAB, max_response=12)
    pack = build_train_pack(b, np.zeros(b.num_responses, np.float32))
    assert pack.num_seqs > 5
    cu_kw = {"cu_seqlens": pack.cu_seqlens, "max_seqlen": pack.max_seqlen} if pass_cu else {}
    with torch.no_grad():
        lp, ent = policy(pack.input_ids.long()[None], pack.position_ids.long()[None], pack.targets.long()[None],
                         **cu_kw)
        pad = build_padded_pack(b, np.zeros(b.num_responses, np.float32))
        lp_pad, ent_pad = policy(pad.input_ids.long(), pad.position_ids.long(), pad.targets.long(),
                                 attention_mask=pad.attention_mask.long())
        alone = []
        cu = pack.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            x = pack.input_ids[a:b].long()[None]
            logits = policy.hf(input_ids=x).logits[0].float()
            alone.append(torch.log_softmax(logits, -1).gather(-1, pack.targets[a:b].long()[:, None])[:, 0])
    m = pad.attention_mask
    return (lp[0], ent[0]), (lp_pad[m], ent_pad[m]), torch.cat(alone)


@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex"])
def test_packed_and_padded_logprobs_agree(tiny_chat_path, impl: str) -> None:
    """Every packed kernel that runs on CPU keeps attention inside each sequence:
    packed == padded == each sequence alone (flex: forward only, as on CPU
    torch has no flex backward)."""
    (lp, ent), (lp_pad, ent_pad), alone = _packed_padded_alone(policy_module(tiny_chat_path, impl))
    torch.testing.assert_close(lp, lp_pad, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_pad, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lp, alone, atol=2e-5, rtol=1e-5)


def test_packed_without_cu_seqlens_derives_them(tiny_chat_path) -> None:
    (lp, _), (lp_pad, _), _ = _packed_padded_alone(policy_module(tiny_chat_path, "sdpa"), pass_cu=False)
    torch.testing.assert_close(lp, lp_pad, atol=2e-5, rtol=1e-5)


def test_auto_attention_is_per_sequence_sdpa_on_cpu() -> None:
    assert resolve_attn_implementation(BackendConfig(model_path="x")) == "sdpa"
    for impl in ("varlen", "flex", "flash_attention_2"):
        with pytest.raises(ValueError, match=f"{impl} needs device='cuda'"):
            BackendConfig(model_path="x", attn_implementation=impl)


# -- hand-off ------------------------------------------------------------------
def test_handoff_round_trip_and_unlink() -> None:
    split = make_split(3, num_minibatches=2, max_tokens=24)
    w = PackWriter()
    try:
        hs = w.write(split)
        assert w.grew == 1 and len(list_segments(os.getpid())) == 1
        for r, h in enumerate(hs):
            assert h.offset % 4096 == 0 and h.segment == w.segment.name
            lp = LocalPack(h)
            s0, s1 = split.rank_seq_range(r)
            assert lp.pack.num_seqs == s1 - s0
            for k in range(split.num_minibatches):
                for m in range(split.num_micro):
                    a, b = split.micro(r, k, m), lp.micro(k, m)
                    for f in ("input_ids", "targets", "position_ids", "loss_mask", "old_logprobs",
                              "advantages", "cu_seqlens", "seq_weights", "sample_index"):
                        assert torch.equal(getattr(a, f), getattr(b, f)), f
                    assert torch.equal(a.local_seq_index(), b.local_seq_index())
            # bytes transport (remote rank) gives the same views
            payload = bytearray(w.region_bytes(h))
            from dataclasses import replace

            lb = LocalPack(replace(h, segment=None, offset=0), payload)
            assert torch.equal(lb.pack.input_ids, lp.pack.input_ids)
            del lp, lb
    finally:
        w.close()
    assert list_segments(os.getpid()) == []


def test_handoff_grows_only_when_needed() -> None:
    w = PackWriter()
    try:
        small = make_split(2, seed=1)
        w.write(small)
        first = w.segment.name
        for _ in range(3):
            w.write(small)
        assert w.segment.name == first and w.grew == 1
        b = random_batch(seed=9, num_prompts=64, vocab=VOCAB, max_response=40)
        adv = np.zeros(b.num_responses, np.float32)
        w.write(build_split_pack(b, adv, world_size=2, max_tokens=256))
        assert w.grew == 2 and w.segment.name != first
        assert not os.path.exists(f"/dev/shm/{first}")
    finally:
        w.close()


# -- schedule and config -------------------------------------------------------
def test_lr_schedule_warmup_then_cosine_to_floor() -> None:
    f = lr_lambda(BackendConfig(model_path="x", warmup_steps=4, total_steps=14, min_lr_ratio=0.1))
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(9) == pytest.approx(0.55)
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert lr_lambda(BackendConfig(model_path="x"))(1000) == 1.0


@pytest.mark.parametrize("kw,msg", [
    ({"world_size": 0}, "backend.world_size"),  # bf16 on CPU is valid: ranks train it under gloo
    ({"strategy": "zero3"}, "backend.strategy: expected one of auto, fsdp2, ddp"),
    ({"world_size": 3, "engine": EngineSpec(tensor_parallel_size=2)}, "must divide world_size 3"),
    ({"max_nan_steps": 0}, "backend.max_nan_steps"),
    ({"betas": (0.9, 1.5)}, "backend.betas"),
    ({"device": "cuda", "attn_implementation": "varlen"}, "varlen needs dtype='bfloat16'"),
])
def test_config_errors_name_the_field(kw, msg) -> None:
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        BackendConfig(model_path="x", **kw)


# -- one rank in this process ----------------------------------------------------
@contextlib.contextmanager
def local_worker(path, monkeypatch, **kw):
    import torch.distributed as dist

    from areno.backend.worker import RankWorker

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    threads = torch.get_num_threads()
    worker = RankWorker(BackendConfig(model_path=str(path), **kw))
    try:
        yield worker
    finally:
        worker.close()
        torch.set_num_threads(threads)
        assert not dist.is_initialized()


def test_one_device_to_host_readback_per_optimizer_step(tiny_chat_path, monkeypatch) -> None:
    """item/tolist/cpu are patched inside the train step: exactly one call per
    optimizer step (the stacked metric readback), with recompute and KL on."""
    split = make_split(1, num_minibatches=3, max_tokens=48)
    loss = LossConfig(kl_coef=0.05, tis_cap=2.0)
    with local_worker(tiny_chat_path, monkeypatch, lr=1e-3, ppo_epochs=2, recompute_logprobs=True,
                      loss=loss) as worker:
        writer = PackWriter()
        try:
            (h,) = writer.write(split)
            worker.cmd_train(h)  # warm-up (lazy init paths)
            calls: list[str] = []
            originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu")}

            def counting(name):
                orig = originals[name]

                def f(self, *a, **k):
                    calls.append(name)
                    return orig(self, *a, **k)
                return f

            for n in originals:
                monkeypatch.setattr(torch.Tensor, n, counting(n))
            out = worker.cmd_train(h)
            for n, f in originals.items():
                monkeypatch.setattr(torch.Tensor, n, f)
        finally:
            writer.close()
    steps = out["steps"]
    assert len(steps) == 2 * 3
    assert calls == ["tolist"] * len(steps), calls
    assert all(s["kl"] >= 0 and s["num_tokens"] > 0 for s in steps)
    # every metric the rank reports is in the table (the trainer reduces it by its row)
    assert all(s.keys() == set(REPORTED) for s in steps), steps[0].keys() ^ set(REPORTED)


def train_once(worker, split) -> list[dict]:
    """One train command of `worker` on `split`, through a real shared-memory pack."""
    writer = PackWriter()
    try:
        (h,) = writer.write(split)
        return worker.cmd_train(h)["steps"]
    finally:
        writer.close()


def test_one_update_takes_its_own_log_probs_detached_as_old_without_a_second_pass(
        tiny_chat_path, monkeypatch) -> None:
    """With the trainer's old log-probs and one update per step, the ratio is the
    update's own forward over itself, detached: exactly 1 (no clip, no noise), and
    no separate no-grad pass; the update equals the one that recomputes them. With
    two mini-batches the old log-probs are recomputed once, before the first."""
    from areno.backend import step

    passes: list[int] = []
    recompute = step.no_grad_logprobs
    monkeypatch.setattr(step, "no_grad_logprobs", lambda *a: passes.append(1) or recompute(*a))
    loss = LossConfig(tis_cap=2.0)
    with local_worker(tiny_chat_path, monkeypatch, lr=1e-3, recompute_logprobs=True, loss=loss) as worker:
        before = {n: p.detach().clone() for n, p in worker.hf.named_parameters()}
        (own,) = train_once(worker, make_split(1, num_minibatches=1))
        after_own = {n: p.detach().clone() for n, p in worker.hf.named_parameters()}
        assert passes == []
        assert (own["ratio_max"], own["ratio_mean"], own["clip_frac"]) == (1.0, 1.0, 0.0)
        assert own["tis_weight"] != 1.0  # the sampler's mismatch still weighs each token
        with torch.no_grad():
            for n, p in worker.hf.named_parameters():
                p.copy_(before[n])
        monkeypatch.setattr(step, "own_old_logprobs", lambda cfg, k: False)
        worker.trainer.optimizer.state.clear()
        worker.trainer.step = 0
        (recomputed,) = train_once(worker, make_split(1, num_minibatches=1))
        assert passes == [1]
        assert recomputed["loss"] == pytest.approx(own["loss"], rel=1e-6, abs=1e-9)
        for n, p in worker.hf.named_parameters():
            torch.testing.assert_close(p.detach(), after_own[n], rtol=1e-5, atol=1e-7, msg=n)
    assert step.own_old_logprobs(BackendConfig(model_path="m", recompute_logprobs=True), 2) is False


def test_nan_steps_are_skipped_then_k_in_a_row_stop(tiny_chat_path, monkeypatch) -> None:
    good, bad = make_split(1, num_minibatches=2), make_split(1, num_minibatches=2, nan_adv=True)
    with local_worker(tiny_chat_path, monkeypatch, lr=1e-3, max_nan_steps=3) as worker:
        writer = PackWriter()
        try:
            before = {n: p.detach().clone() for n, p in worker.hf.named_parameters()}
            (h,) = writer.write(bad)
            out = worker.cmd_train(h)["steps"]
            assert [s["nan_skipped"] for s in out] == [1.0, 1.0]
            assert [s["step"] for s in out] == [0.0, 0.0]
            for n, p in worker.hf.named_parameters():
                assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
            (h,) = writer.write(good)
            out = worker.cmd_train(h)["steps"]
            assert [s["nan_skipped"] for s in out] == [0.0, 0.0] and out[-1]["step"] == 2.0
            assert worker.trainer.nan_streak == 0
            (h,) = writer.write(bad)
            worker.cmd_train(h)  # streak 2
            (h,) = writer.write(make_split(1, num_minibatches=1, nan_adv=True))
            with pytest.raises(NonFiniteStepsError, match="3 optimizer steps in a row"):
                worker.cmd_train(h)
        finally:
            writer.close()


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_update(tiny_chat_path, monkeypatch, lora) -> None:
    """A rank's train command with --grad-checkpointing recomputes every decoder
    layer of every micro-batch in backward (it cannot pass without checkpointing:
    the attention calls double) and lands bit-equal weights, LoRA's too."""
    from areno.backend.config import LoraSpec

    split = make_split(1)
    states, calls = [], []
    spec = LoraSpec(rank=4, alpha=8.0) if lora else None
    for ckpt in (False, True):
        with local_worker(tiny_chat_path, monkeypatch, lr=1e-3, grad_checkpointing=ckpt, lora=spec) as worker:
            n = [0]
            for layer in worker.hf.model.layers:  # fires in forward and again in each recompute
                layer.self_attn.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
            writer = PackWriter()
            try:
                (h,) = writer.write(split)
                worker.cmd_train(h)
            finally:
                writer.close()
            calls.append(n[0])
            states.append(full_state(worker))
    assert calls[0] > 0 and calls[1] == 2 * calls[0], calls
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_bfloat16_publish_writes_the_engines_dtype_and_an_engine_loading_it_passes(tiny_chat_path,
                                                                                     monkeypatch) -> None:
    """The GPU path syncs bf16: the region holds the trainer's weights in bf16 and
    a bf16 engine loading it matches the fingerprint and the trainer's probe."""
    from areno.procs.segment import ShmSegment
    from areno.fleet.weight_sync import SyncCheck, WeightLayout, WeightRegion, load_region, region_tensors
    from areno.backend.weights import probe_ids
    from areno.rollout.hf import HFEngine

    with local_worker(tiny_chat_path, monkeypatch, dtype="bfloat16") as worker:
        layout = WeightLayout.build(worker.export_meta)
        seg = ShmSegment("weights")
        try:
            seg.ensure(layout.nbytes, headroom=0.0)
            out = worker.cmd_publish_weights(seg.name, layout, probe_ids(worker.vocab_size))
            full = full_state(worker)
            for n, t in region_tensors(seg.buf, layout):
                assert t.dtype == torch.bfloat16 and torch.equal(t, full[n].to(torch.bfloat16)), n
            engine = HFEngine(tiny_chat_path, dtype="bfloat16", device="cpu")
            region = WeightRegion(seg.name, layout, out["fingerprint"], out["probe"])
            got = load_region(engine, region, SyncCheck(True, 0))
            assert got["probe_diff"] <= got["probe_tolerance"]
            engine.shutdown()
        finally:
            seg.unlink()


def test_packed_forward_builds_no_mask(tiny_chat_path, monkeypatch) -> None:
    """The training path never builds an [L, L] mask nor scans position_ids for
    restarts (a host sync on GPU): transformers' mask builders must not run."""
    import transformers.masking_utils as mu

    def boom(*a, **k):
        raise AssertionError("a mask was built on the packed path")

    for name in ("sdpa_mask", "eager_mask", "find_packed_sequence_indices"):
        monkeypatch.setattr(mu, name, boom)
    monkeypatch.setattr(mu.ALL_MASK_ATTENTION_FUNCTIONS, "_global_mapping",
                        {k: boom for k in mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping})
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def no_mask_sdpa(q, k, v, attn_mask=None, **kw):
        assert attn_mask is None, f"sdpa got a mask of shape {tuple(attn_mask.shape)}"
        calls.append((q.shape[0], q.shape[-2]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_mask_sdpa)
    policy = policy_module(tiny_chat_path, "sdpa")
    b = random_batch(seed=3, vocab=VOCAB, max_response=12)
    pack = build_train_pack(b, np.zeros(b.num_responses, np.float32))
    lp, _ = policy(pack.input_ids.long()[None], pack.position_ids.long()[None], pack.targets.long()[None],
                   cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen)
    lp.sum().backward()
    assert torch.isfinite(lp).all()
    # one call per distinct length and layer, over every sequence of that length
    # as a batch, each only as long as its sequences (no padding)
    lengths, counts = np.unique(np.diff(pack.cu_seqlens.numpy()), return_counts=True)
    assert sorted(calls) == sorted(list(zip(counts.tolist(), lengths.tolist())) * policy.hf.config.num_hidden_layers)


def test_auto_attention_on_cuda_prefers_flash_attn_then_varlen_then_flex(monkeypatch) -> None:
    from areno.backend import attention

    for fa, vl, want in ((True, True, "flash_attention_2"), (False, True, "varlen"), (False, False, "flex")):
        monkeypatch.setattr(attention, "has_flash_attn", lambda fa=fa: fa)
        monkeypatch.setattr(attention, "has_torch_varlen", lambda vl=vl: vl)
        assert attention.auto_impl("cuda", "bfloat16") == want
        # both flash kernels take fp16/bf16 only: fp32 compute gets flex
        assert attention.auto_impl("cuda", "float32") == "flex"


def test_cpu_ranks_split_every_core_and_wait_passively() -> None:
    """Every core, split among the ranks (one thread per rank cost the idle real
    model 1.3-1.75x on 2 cores, issue 26), made safe next to busy processes by
    OpenMP's passive wait, which a user's own setting overrides; none on CUDA."""
    from areno.procs.device import rank_cpu_threads
    from areno.backend.launch import RANK_OMP_ENV, rank_omp_env

    assert [rank_cpu_threads(2, 1), rank_cpu_threads(2, 2), rank_cpu_threads(16, 1), rank_cpu_threads(16, 8),
            rank_cpu_threads(1, 1), rank_cpu_threads(3, 2), rank_cpu_threads(2, 4)] == [2, 1, 16, 2, 1, 1, 1]
    assert rank_omp_env("cpu", {}, others=1) == RANK_OMP_ENV == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert rank_omp_env("cpu", {}, others=None) == RANK_OMP_ENV  # load unknown: the safe wait
    assert rank_omp_env("cpu", {"OMP_WAIT_POLICY": "ACTIVE"}, others=0) == {"KMP_BLOCKTIME": "0"}
    assert rank_omp_env("cuda", {}, others=0) == {}


def test_cpu_ranks_spin_briefly_only_on_an_otherwise_idle_host(tmp_path: Path, monkeypatch) -> None:
    """An idle host gets a short spin before the passive sleep (waking sleepers
    at every barrier cost the idle demo's train phase ~1.7x); a runnable
    neighbour, or the user's own wait policy or spin count, keeps it passive."""
    from areno.backend import launch
    from areno.backend.launch import (IDLE_SPIN_ENV, RANK_OMP_ENV, own_tree_running, rank_omp_env,
                                      runnable_elsewhere)

    assert rank_omp_env("cpu", {}, others=0) == {**RANK_OMP_ENV, **IDLE_SPIN_ENV} == {
        "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "GOMP_SPINCOUNT": "30000"}
    assert rank_omp_env("cpu", {"GOMP_SPINCOUNT": "5"}, others=0) == RANK_OMP_ENV
    assert rank_omp_env("cpu", {"OMP_WAIT_POLICY": "PASSIVE"}, others=0) == {"KMP_BLOCKTIME": "0"}
    fake = tmp_path / "loadavg"
    with monkeypatch.context() as m:  # the fake counts against this tree's live count: fix it at the reader
        m.setattr(launch, "own_tree_running", lambda: 1)
        fake.write_text("0.50 0.40 0.30 1/96 4017\n")  # only the reader runs
        assert runnable_elsewhere(samples=3, interval_s=0, loadavg=str(fake)) == 0
        fake.write_text("2.10 1.40 0.30 3/96 4017\n")
        assert runnable_elsewhere(samples=3, interval_s=0, loadavg=str(fake)) == 2
    assert runnable_elsewhere(loadavg=str(tmp_path / "absent")) is None
    # A busy child is the run's own (the resource tracker starting beside the
    # early spawn): not a neighbour.
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past its start-up: it is runnable from now on
        assert own_tree_running() >= 2  # this thread and the child
    finally:
        child.kill()
        child.wait()
    # A neighbour outside this process tree (the shell exits; init adopts it).
    pid = int(subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.3)
        assert runnable_elsewhere() >= 1
        assert "GOMP_SPINCOUNT" not in rank_omp_env("cpu", {})  # the real count: a neighbour spins
    finally:
        os.kill(pid, signal.SIGKILL)


def test_probe_runs_every_sync_unless_a_fingerprint_checks_the_weights() -> None:
    from areno.rollout.probe import PROBE_EVERY_FINGERPRINTED as K, probe_due

    assert all(probe_due(i, fingerprinted=False) for i in range(2 * K + 1))
    assert [i for i in range(2 * K + 1) if probe_due(i, fingerprinted=True)] == [0, K, 2 * K]


def test_weight_stream_converts_to_the_engine_dtype_and_sums_squares_only_when_asked() -> None:
    from areno.fleet.weight_sync import WeightStream

    named = [("m.a.weight", torch.tensor([1.0, 2.0])), ("m.b.weight", torch.tensor([[3.0]])),
             ("lm_head.weight", torch.tensor([0.5]))]
    s = WeightStream(iter(named), torch.bfloat16)
    got = list(s)
    assert [n for n, _ in got] == s.names == [n for n, _ in named] and got[0][1].dtype == torch.bfloat16
    assert got[0][1].data_ptr() != named[0][1].data_ptr()
    fp = s.fingerprint()  # grouped by module path: "m" holds a and b
    assert fp.sums == {"m": 14.0, "": 0.25} and fp.counts == {"m": 3, "": 1}
    off = WeightStream(iter(named), torch.float32, fingerprint=False)
    assert len(list(off)) == 3 and off.fingerprint().sums == {}


def test_weight_stream_does_not_copy_a_tensor_already_in_the_engine_dtype() -> None:
    # Copy once (issue 26, 4): the engine's load is the copy; a stream copy would be a second.
    from areno.fleet.weight_sync import WeightStream

    named = [("m.a.weight", torch.tensor([1.0, 2.0])), ("lm_head.weight", torch.tensor([0.5]))]
    got = list(WeightStream(iter(named), torch.float32))
    assert [t.data_ptr() for _, t in got] == [t.data_ptr() for _, t in named]


def test_start_up_runs_without_the_collector_and_freezes_what_it_built() -> None:
    """procs.lifecycle.start_up: the collector is off inside, on again after (also
    when the start-up raises), and what was built inside is frozen."""
    import gc

    from areno.procs.lifecycle import start_up

    before = gc.get_freeze_count()
    try:
        with pytest.raises(KeyError), start_up():
            assert not gc.isenabled()
            built = [[i] for i in range(10_000)]
            raise KeyError("a failed start-up")
        assert gc.isenabled() and gc.get_freeze_count() >= before + len(built)
    finally:
        gc.unfreeze()  # this process is pytest's, which ends in a normal exit


def _fail_start_up(conn) -> None:
    from areno.errors import UserError
    from areno.procs.serve import serve_worker

    def make():
        raise UserError("--kv-cache-gb 1e+06: more than this host has")

    serve_worker(make, conn, 0)  # reports the error, then ends the process at once


def test_a_peer_that_fails_its_start_up_is_reported_by_its_error_not_as_a_death() -> None:
    """Its error is read in the same wait that sees it exit: the one line is the
    error, not 'died (exit code 1); then ...'."""
    import multiprocessing as mp

    from areno.procs.errors import RankUserError
    from areno.procs.replies import Peers

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_fail_start_up, args=(child,))
    p.start()
    peers = Peers([parent], [p], abort=lambda: None, is_closed=lambda: False)
    with pytest.raises(RankUserError) as err:
        peers.recv(0, "startup")
    p.join(30)
    assert p.exitcode == 1
    assert peers.death(0, "startup", [err.value]) is err.value
    assert str(err.value) == "--kv-cache-gb 1e+06: more than this host has"
