"""Route eligible PEFT LoRA modules through the fused autograd functions of ``lora_ops``.

A module is eligible when it computes exactly ``base(x) + B(A(x)) * s``: one active adapter, plain LoRA
(no DoRA or other variant; LoRA-GA's ``s [B, -B0] [A; A0] x`` is one such pair of rank 2r), no dropout, no LoRA bias, not merged, and a base that is a plain ``nn.Linear``
or a bitsandbytes ``Linear4bit``. Anything else keeps PEFT's own forward, module by module, so a model
is never half-wrong: at worst it is half-fast. The patch is an instance attribute (``forward``), so
``state_dict``, ``save_pretrained`` and merging see the same modules as before.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from trainer.fastpath.lora_ops import BaseWeight, lora_group, lora_linear, lora_mlp

PARTS = "_kit_lora_parts"
STASH = "_kit_group_output"  # on K and V: (the input, their output) left there by Q's grouped call
QKV = ("q_proj", "k_proj", "v_proj")


def _base_linear(module) -> nn.Module | None:
    base = getattr(module, "base_layer", None)
    if type(base) is nn.Linear:
        return base
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    if isinstance(base, bnb.nn.Linear4bit):
        return base
    return None


def lora_spec(module) -> tuple | None:
    """(A module, B module, base module, scale) when ``module`` is a plain-LoRA Linear, else None.

    The modules, not their tensors: under FSDP2 a layer's parameters are other tensors at each call (gathered
    for its forward and backward, sharded between), so the tensors are read at the call (``parts_of``)."""
    if not hasattr(module, "lora_A") or getattr(module, "merged", False) or module.disable_adapters:
        return None
    active = list(module.active_adapters)
    if len(active) != 1:
        return None
    name = active[0]
    if name not in module.lora_A:
        return None
    variant = getattr(module, "lora_variant", {}).get(name)
    if variant is not None and type(variant).__name__ != "LoraGaVariant":
        return None
    if getattr(module, "use_dora", {}).get(name, False):
        return None
    dropout = module.lora_dropout[name]
    if not isinstance(dropout, nn.Identity) and not (isinstance(dropout, nn.Dropout) and dropout.p == 0):
        return None
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_b.bias is not None:
        return None
    base = _base_linear(module)
    if base is None:
        return None
    return lora_a, lora_b, base, float(module.scaling[name])


def base_weight(base: nn.Module) -> BaseWeight:
    """The base projection's weight as it is now. FSDP2's gathered copy of a 4-bit weight is a plain tensor
    without its quantization state; bitsandbytes' own Linear4bit.forward puts it back the same way."""
    if getattr(base.weight, "quant_state", None) is None and getattr(base, "quant_state", None) is not None:
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

        fix_4bit_weight_quant_state_from_module(base)
    return BaseWeight(base.weight, base.bias)


def parts_of(spec: tuple) -> tuple:
    """(A weight, B weight, BaseWeight, scale) of a ``lora_spec``, read now."""
    lora_a, lora_b, base, scale = spec
    return lora_a.weight, lora_b.weight, base_weight(base), scale


def lora_parts(module) -> tuple | None:
    """(A weight, B weight, BaseWeight, scale) when ``module`` is a plain-LoRA Linear, else None."""
    spec = lora_spec(module)
    return None if spec is None else parts_of(spec)


def cached_parts(module) -> tuple | None:
    """``lora_parts``, its modules worked out once per active adapter (the forward runs thousands of times a
    step) and their tensors read at each call."""
    if module.disable_adapters or module.merged:
        return None
    key = tuple(module.active_adapters)
    cached = module.__dict__.get(PARTS)
    if cached is None or cached[0] != key:
        cached = (key, lora_spec(module))
        module.__dict__[PARTS] = cached
    if cached[1] is None:
        return None
    parts = parts_of(cached[1])
    if "lora_ga_A0" in module._buffers:
        return _with_initial_factors(module, parts)
    return parts


def _with_initial_factors(module, parts: tuple) -> tuple:
    """LoRA-GA's layer computes s [B, -B0] [A; A0] x (trainer/peft_methods/lora_ga.py): one LoRA pair of rank
    2r, built at each call from the trained factors (gradients flow back through the concatenation) and the
    frozen initial ones, so the fused functions run it as they run plain LoRA."""
    a, b, base, scale = parts
    a0, b0 = module.lora_ga_A0, module.lora_ga_B0
    return torch.cat([a, a0.to(a.dtype)]), torch.cat([b, -b0.to(b.dtype)], dim=1), base, scale


def _fast_linear_forward(self, x, *args, **kwargs):
    parts = None if args or kwargs else cached_parts(self)
    if parts is None:  # adapter_names or other per-call options, adapters disabled or merged: PEFT's path
        return type(self).forward(self, x, *args, **kwargs)
    return lora_linear(x, *parts)


def patch_lora_linears(model: nn.Module) -> tuple[int, int]:
    """Patch every eligible LoRA Linear; returns (patched, LoRA modules left on PEFT's forward)."""
    patched = skipped = 0
    for module in model.modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        if lora_parts(module) is None:
            skipped += 1
            continue
        module.forward = types.MethodType(_fast_linear_forward, module)
        patched += 1
    return patched, skipped


def _grouped_leader_forward(self, x, *args, **kwargs):
    """Q's forward: computes K and V too, in one node, and leaves their outputs on those modules for the
    calls that follow with the same input (attention code calls q, k, v on one hidden-states tensor)."""
    members = self.__dict__["_kit_group_members"]
    parts = None if args or kwargs else [cached_parts(m) for m in (self, *members)]
    if parts is None or any(p is None for p in parts):
        return _fast_linear_forward(self, x, *args, **kwargs)
    outputs = lora_group(x, *parts)
    for member, out in zip(members, outputs[1:]):
        member.__dict__[STASH] = (x, out)
    return outputs[0]


def _grouped_member_forward(self, x, *args, **kwargs):
    """K's or V's forward: the output Q's call computed for this very input, else its own single node."""
    stash = self.__dict__.pop(STASH, None)
    if stash is not None and stash[0] is x and not args and not kwargs:
        return stash[1]
    return _fast_linear_forward(self, x, *args, **kwargs)


def patch_qkv_groups(model: nn.Module) -> int:
    """Q/K/V of each attention block whose three projections are eligible LoRA modules, as one group.

    Relies only on the attention code calling q, then k and v, on the same tensor; any other order or input
    falls back to each projection's own node, so a model that does otherwise is slower, never wrong."""
    count = 0
    for module in model.modules():
        if not all(hasattr(module, n) for n in QKV):
            continue
        projections = [getattr(module, n) for n in QKV]
        if any(not hasattr(p, "lora_A") or lora_parts(p) is None for p in projections):
            continue
        leader, *members = projections
        leader.__dict__["_kit_group_members"] = members
        leader.forward = types.MethodType(_grouped_leader_forward, leader)
        for member in members:
            member.forward = types.MethodType(_grouped_member_forward, member)
        count += 1
    return count


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in {"SiLUActivation", "SiLU"}


def _fast_mlp_forward(self, x):
    parts = [cached_parts(getattr(self, name)) for name in ("gate_proj", "up_proj", "down_proj")]
    if any(p is None for p in parts):
        return type(self).forward(self, x)
    return lora_mlp(x, *parts)


def patch_swiglu_mlps(model: nn.Module) -> int:
    """Patch gate/up/down SwiGLU blocks whose three projections are all eligible LoRA modules."""
    count = 0
    for module in model.modules():
        names = ("gate_proj", "up_proj", "down_proj")
        if not all(hasattr(module, n) for n in names) or not _is_silu(getattr(module, "act_fn", None)):
            continue
        if any(lora_parts(getattr(module, n)) is None for n in names):
            continue
        module.forward = types.MethodType(_fast_mlp_forward, module)
        count += 1
    return count


def unpatch(model: nn.Module) -> None:
    """Back to the classes' forwards (used by the reference comparison in the benchmark and tests)."""
    for module in model.modules():
        if "forward" in module.__dict__ and getattr(module.__dict__["forward"], "__func__", None) in (
            _fast_linear_forward,
            _fast_mlp_forward,
            _grouped_leader_forward,
            _grouped_member_forward,
        ):
            del module.forward
        for key in (PARTS, STASH, "_kit_group_members"):
            module.__dict__.pop(key, None)


def lora_module_count(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
