"""--grad-checkpointing checkpoints every decoder layer (issue 26, 2).

transformers' gradient_checkpointing_enable checkpoints only in train mode and
the policy is in eval mode, so it did nothing. backend.model.checkpoint_layers
wraps each layer's forward in torch.utils.checkpoint instead. Measured on CPU
with the tiny model: the bytes of activations autograd saves (a
saved_tensors_hooks pack hook, parameters left out) and the recomputations in
backward (a forward pre-hook on each layer's attention fires again when the
layer is recomputed); the gradients are bit-equal to those without.
"""

from __future__ import annotations

import torch

from areno.backend.model import PolicyModule, checkpoint_layers, cu_seqlens_from_positions, load_hf_model

LENS = [30, 50, 20]  # one packed micro-batch of three sequences


def measure(hf) -> dict:
    """One grad forward + backward of a packed micro-batch through `hf`: saved bytes
    inside / outside the decoder layers, attention calls in forward and in total,
    and every parameter's gradient."""
    pol = PolicyModule(hf, chunk_size=64)
    ids = torch.randint(0, hf.config.vocab_size, (1, sum(LENS)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    cu, max_len = cu_seqlens_from_positions(pos[0])
    params = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    state = {"inside": False, "in": 0, "out": 0, "calls": 0, "seen": set()}

    def enter(*_):
        state["inside"] = True

    def leave(*_):
        state["inside"] = False

    def attention_call(*_):
        state["calls"] += 1

    for layer in hf.model.layers:
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
        layer.self_attn.register_forward_pre_hook(attention_call)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.nbytes)
        if key[0] not in params and key not in state["seen"]:  # activations, each buffer once
            state["seen"].add(key)
            state["in" if state["inside"] else "out"] += t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = pol(ids, pos, torch.roll(ids, -1, 1), cu_seqlens=cu, max_seqlen=max_len)
    forward_calls = state["calls"]
    logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    return dict(inside=state["in"], outside=state["out"], forward_calls=forward_calls,
                recomputed=state["calls"] - forward_calls, grads=grads)


def test_checkpointing_keeps_only_each_layers_input_and_gives_bit_equal_gradients(tiny_chat_path) -> None:
    plain = measure(load_hf_model(tiny_chat_path, "sdpa", torch.device("cpu")))
    hf = load_hf_model(tiny_chat_path, "sdpa", torch.device("cpu"))
    n_layers = checkpoint_layers(hf)
    ck = measure(hf)
    hidden = hf.config.hidden_size
    assert n_layers == hf.config.num_hidden_layers == 2
    # every layer ran once in forward and once more in backward (its recompute)
    assert plain["recomputed"] == 0 and ck["forward_calls"] == plain["forward_calls"] == n_layers
    assert ck["recomputed"] == n_layers
    # inside the layers only their inputs stay ([L, H] fp32 each); outside nothing changes
    assert ck["inside"] == n_layers * sum(LENS) * hidden * 4 and ck["outside"] == plain["outside"]
    factor = (plain["inside"] + plain["outside"]) / (ck["inside"] + ck["outside"])
    # tiny chat (2 layers, H 128, 4 heads, MLP 256, 100 positions): 2.34 MB -> 0.26 MB
    assert plain["inside"] >= 20 * ck["inside"] and factor > 8, (plain, ck, factor)
    for name, g in plain["grads"].items():
        assert torch.equal(g, ck["grads"][name]), name


def test_checkpointing_leaves_the_policy_in_eval_mode_so_dropout_configs_stay_off(tiny_chat_path, tmp_path) -> None:
    """A model whose config asks for attention dropout: checkpointing must not turn
    it on (train mode would), so the update stays the deterministic one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_chat_path)
    cfg.attention_dropout = 0.5
    path = tmp_path / "dropout-model"
    AutoModelForCausalLM.from_pretrained(tiny_chat_path, config=cfg).save_pretrained(path)
    plain = measure(load_hf_model(path, "eager", torch.device("cpu")))
    hf = load_hf_model(path, "eager", torch.device("cpu"))
    checkpoint_layers(hf)
    ck = measure(hf)
    assert ck["recomputed"] == 2 and not any(m.training for m in hf.modules())
    for name, g in plain["grads"].items():
        assert torch.equal(g, ck["grads"][name]), name
