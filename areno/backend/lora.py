"""LoRA on the ranks: peft adapters around the policy's linears, base weights frozen.

`apply_lora` wraps the fp32 HF model with `peft.get_peft_model` (B = 0 at init,
so step 0 is the base model exactly) and returns the *inner* HF model, whose
linears are now peft `lora.Linear` modules: `PolicyModule`, FSDP2's per-layer
`fully_shard` and the state walks keep finding `hf.model.layers`, `hf.lm_head`
and `hf.config` where they were. Only the adapters require grad, so only they
reach AdamW and the optimizer state.

Weight sync: the base weights are frozen and already in the engine, so only the
adapter travels (`adapter_state`, loaded and fingerprinted by
fleet.adapter_sync). `merged_state` is the merged view under the base model's
own tensor names, W = W0 + scaling * B @ A computed per target linear from the
gathered tensors (nothing is merged in place, which on FSDP2's sharded DTensors
would be unsafe): what `--save-merged` writes into `merged/`.

Checkpoints: `adapter_state` gathers the adapters under peft's saved names
(`base_model.model.<module>.lora_A.weight`), `save_adapter` writes them with
`adapter_config.json` as `PeftModel.save_pretrained` does, and `apply_lora`
loads them back (resume, --eval-only of an adapter checkpoint).

KL: `adapters_disabled` turns every adapter off for the reference forward, so
the reference log-probs are the base model's without a second copy of it.

Dropout (--lora-dropout): on in the update's forward only (`dropout_active`),
where peft means it (a regulariser of the adapters' training); off everywhere
the trainer's log-probs must equal the engine's, which never drops: the sync
probe, --recompute-logprobs, the KL reference, the first sync after --resume
or of --eval-only. peft's nn.Dropout follows the module's train/eval mode,
which get_peft_model leaves in train mode and --grad-checkpointing sets for
the whole model, so `apply_lora` swaps it for `AdapterDropout`, which ignores
the mode and acts only while its `active` flag is set. Its masks come from the
rank's torch RNG, which checkpoints save and resume restores (worker), so a
resumed run draws the uninterrupted run's masks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from areno.backend.config import LoraSpec
from areno.models.directory import ADAPTER_WEIGHTS

ADAPTER = "default"  # peft's adapter name; saved files carry none
HEAD = "lm_head"  # the one target outside the decoder layers (--lora-target-modules all-linear,lm_head)
_PREFIX = "base_model.model."  # peft's saved key prefix in front of the HF module name


def linear_names(model: nn.Module) -> list[str]:
    """Leaf names of the nn.Linear modules inside the decoder layers (attention and
    MLP: lm_head and the embeddings are outside them), in first-seen order."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    seen: dict[str, None] = {}
    for name, mod in layers.named_modules():
        if isinstance(mod, nn.Linear):
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def resolve_targets(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """('all-linear',) -> every linear leaf name of the decoder layers; otherwise the
    names given, each checked (ValueError naming the first one the model lacks).
    `lm_head` may be added (alone or beside all-linear): the output projection,
    when it is a linear of its own (untied; see `head_weight`)."""
    have = linear_names(model)
    names = tuple(have) if "all-linear" in targets else ()
    for t in targets:
        if t == HEAD:
            check_head_target(model)
            names += (HEAD,)
        elif t != "all-linear" and t not in have:
            raise ValueError(f"--lora-target-modules: the model has no linear named {t!r} in its "
                             f"decoder layers (it has: {', '.join(have)}; or give all-linear, lm_head)")
        elif t != "all-linear":
            names += (t,)
    return names


def check_head_target(model: nn.Module) -> None:
    """ValueError unless lm_head can carry an adapter that every side serves alike:
    an nn.Linear of its own. A tied lm_head shares its weight with the input
    embedding, so the merged model (--save-merged) could not hold both."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError("--lora-target-modules lm_head: the model's output projection is not a linear")
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("--lora-target-modules lm_head: this model ties lm_head to its input embeddings; "
                         "areno adapts an untied lm_head only (drop lm_head)")


def head_weight(head: nn.Module) -> torch.Tensor:
    """[V, H]: the weight the output projection `head` computes with, as the
    trainer's chunked log-probs need it (they multiply by a weight, not call the
    module): W0 + scaling * B @ A for a peft LoRA lm_head (differentiable in A
    and B; W0 alone while `adapters_disabled`), else `head.weight`. Adapter
    dropout is refused for lm_head (config.lora), so this is the layer's forward."""
    lora_a = getattr(head, "lora_A", None)  # a peft LoraLayer (no peft import on full FT's path)
    if lora_a is None or ADAPTER not in lora_a or head.disable_adapters:
        return head.weight
    a, b = head.lora_A[ADAPTER].weight, head.lora_B[ADAPTER].weight
    w0 = head.get_base_layer().weight
    return w0 + (head.scaling[ADAPTER] * (b @ a)).to(w0.dtype)


def lora_config(spec: LoraSpec, targets: tuple[str, ...], base_path: str):
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(targets), bias="none", task_type="CAUSAL_LM",
                      use_rslora=spec.use_rslora,
                      base_model_name_or_path=base_path)


class AdapterDropout(nn.Dropout):
    """peft's adapter dropout, on only while `active` (`dropout_active`): the
    module's train/eval mode does not switch it (see the module docstring)."""

    active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=True) if self.active else x


def apply_lora(hf: nn.Module, spec: LoraSpec, base_path: str, adapter_path: str | None = None) -> nn.Module:
    """Wrap `hf` (fp32, not yet sharded) with LoRA adapters, base weights frozen;
    adapter weights from `adapter_path` (a saved adapter directory) when given.
    Returns the inner HF model (adapters injected); its `areno_peft` is the PeftModel."""
    from peft import get_peft_model

    targets = resolve_targets(hf, spec.target_modules)
    peft_model = get_peft_model(hf, lora_config(spec, targets, base_path))
    inner = peft_model.get_base_model()
    for n, p in inner.named_parameters():
        p.requires_grad_(".lora_" in n)
    for layer in lora_layers(inner).values():
        for name, d in list(layer.lora_dropout.items()):
            if isinstance(d, nn.Dropout):  # p > 0 (peft puts nn.Identity for 0)
                layer.lora_dropout[name] = AdapterDropout(d.p)
    if adapter_path is not None:
        load_adapter_weights(inner, adapter_path)
    # kept for peft's own helpers; set past nn.Module so it is no submodule (it holds `inner`)
    object.__setattr__(inner, "areno_peft", peft_model)
    return inner


def lora_layers(hf: nn.Module) -> dict[str, nn.Module]:
    """HF module name -> peft LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in hf.named_modules() if isinstance(m, LoraLayer)}


def param_counts(hf: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements (tied tensors once)."""
    params = list(hf.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def merged_state(hf: nn.Module, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's view of a LoRA policy: (base model name, full tensor) for every
    name in `names` (the base model's `hf_state_names`), target linears merged as
    W0 + scaling * B @ A in fp32. One tensor at a time; every rank must iterate to
    the end (FSDP2 gathers are collectives, taken in the same order everywhere)."""
    from areno.backend.weights import tensor_table

    layers = lora_layers(hf)
    table = tensor_table(hf)
    with torch.no_grad():
        for name in names:
            module, _, leaf = name.rpartition(".")
            layer = layers.get(module)
            if layer is None:
                yield name, _full(table[name])
                continue
            base = _full(table[f"{module}.base_layer.{leaf}"])
            if leaf == "weight":
                a = _full(layer.lora_A[ADAPTER].weight)
                b = _full(layer.lora_B[ADAPTER].weight)
                base = base.float() + layer.scaling[ADAPTER] * (b.float() @ a.float())
            yield name, base


def adapter_state(hf: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft saved name, full adapter tensor), one at a time, every rank to the end."""
    for module, layer in lora_layers(hf).items():
        for part in ("lora_A", "lora_B"):
            yield f"{_PREFIX}{module}.{part}.weight", _full(getattr(layer, part)[ADAPTER].weight)


def adapter_meta(hf: nn.Module, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(peft saved name, dtype, full shape) per adapter tensor, in `adapter_state`'s
    order: what a split-placement sync sends under LoRA (weight_sync.WeightLayout).
    Call before the model is sharded (the shapes are the full tensors')."""
    return [(name, dtype, tuple(t.shape)) for name, t in adapter_state(hf)]


def save_adapter(hf: nn.Module, spec: LoraSpec, base_path: str, tensors: dict[str, torch.Tensor],
                 out_dir: Path) -> None:
    """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for m in lora_layers(hf)}))
    lora_config(spec, targets, base_path).save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def load_adapter_weights(hf: nn.Module, adapter_path: str | os.PathLike) -> None:
    """Copy a saved adapter's tensors into the (unsharded) LoRA layers of `hf`;
    ValueError when a layer's tensors are missing or shaped otherwise."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(adapter_path) / ADAPTER_WEIGHTS))
    with torch.no_grad():
        for module, layer in lora_layers(hf).items():
            for part in ("lora_A", "lora_B"):
                key = f"{_PREFIX}{module}.{part}.weight"
                dst = getattr(layer, part)[ADAPTER].weight
                if key not in saved or saved[key].shape != dst.shape:
                    raise ValueError(f"{adapter_path}: adapter tensor {key} is missing or has another "
                                     f"shape than rank {dst.shape} expects")
                dst.copy_(saved[key].to(dst.dtype))


@contextlib.contextmanager
def adapters_disabled(hf: nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer only (peft's own flag, which its
    forward reads): the base model's outputs, exactly. Leaves requires_grad alone
    (peft's enable_adapters would flip it, under FSDP2 on the sharded params)."""
    layers = list(lora_layers(hf).values())
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


@contextlib.contextmanager
def dropout_active(hf: nn.Module, on: bool) -> Iterator[None]:
    """The adapters' dropout on (`on`) for the update's forward, off again after;
    everywhere else it is off (AdapterDropout)."""
    mods = [d for m in lora_layers(hf).values() for d in m.lora_dropout.values()
            if isinstance(d, AdapterDropout)] if on else []
    for d in mods:
        d.active = True
    try:
        yield
    finally:
        for d in mods:
            d.active = False


def check_adapter_modules(model: nn.Module, targets: tuple[str, ...], adapter_path: str) -> None:
    """UserError unless the saved adapter has A and B for exactly the linears
    areno adapts (every decoder linear named in `targets`): an adapter of some
    layers only (full module paths in target_modules, layers_to_transform) would
    otherwise get trained fresh adapters beside its own."""
    from safetensors import safe_open

    from areno.errors import UserError
    from areno.rollout.lora import adapter_module

    with safe_open(str(Path(adapter_path) / ADAPTER_WEIGHTS), "pt") as f:
        names = list(f.keys())
    try:
        saved = {adapter_module(n) for n in names}
    except ValueError as e:
        raise UserError(f"{adapter_path}: {e}") from None
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    want = {(f"{prefix}.{n}", k) for n, m in layers.named_modules() if isinstance(m, nn.Linear)
            and n.rsplit(".", 1)[-1] in targets for k in ("lora_A", "lora_B")}
    if HEAD in targets:
        want |= {(HEAD, "lora_A"), (HEAD, "lora_B")}
    for label, diff in (("has no", want - saved), ("has an adapter the targets do not name:", saved - want)):
        if diff:
            module, kind = sorted(diff)[0]
            raise UserError(f"{adapter_path}: the adapter {label} {kind} for {module} ({len(diff)} such; "
                            f"areno adapts every decoder linear named in target_modules)")


def lora_plan(model_path: str, spec: LoraSpec) -> tuple[int, int]:
    """Controller side, before any rank starts: the target names checked against the
    model (UserError naming the first it lacks) on a weightless meta-device copy;
    returns (trainable, total) parameter elements of the LoRA policy."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from areno.errors import UserError

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        targets = resolve_targets(model, spec.target_modules)
    except ValueError as e:
        raise UserError(str(e)) from None
    if spec.adapter_path is not None:
        check_adapter_modules(model, targets, spec.adapter_path)
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    trainable = sum(spec.rank * (m.in_features + m.out_features) for n, m in layers.named_modules()
                    if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets)
    if HEAD in targets:
        head = model.get_output_embeddings()
        trainable += spec.rank * (head.in_features + head.out_features)
    return trainable, sum(p.numel() for p in model.parameters()) + trainable
