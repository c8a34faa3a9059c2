"""Mamba-2's own fast-path swap: the mixer's gated RMSNorm on fla's fused Triton kernel.

transformers' ``MambaRMSNormGated`` computes ``x * silu(gate)``, then RMSNorm per group, in fp32 eager maths:
about ten elementwise passes over a [tokens, d_inner] fp32 tensor in the forward and twice that in the backward,
each tensor kept for autograd. On a Mamba-2 130M step (16 x 2048 tokens, H100) copies, casts and elementwise
kernels took 240 of 405 GPU ms. fla ships mamba_ssm's gated norm (``fla.modules.norm.layernorm_gated``,
``norm_before_gate=False``): one kernel each way, saving only x, gate and the per-row rstd, and here writing
its output in the dtype out_proj takes.

Only on the ``fla-triton-ssd`` path (mamba_ssm's training forward fuses the norm into its own kernel), only on
the model being trained (per module, never transformers' class: a Trainer run in the same process keeps its
code), and only after ``check_gated_norm`` passed on the run's GPU (trainer/fastpath ``apply_to_family``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from trainer.kernelcheck import compare, random_leaves

GATED_NORM = "mamba2_gated_rms_norm"


def group_size(norm) -> int:
    """The norm's group width. transformers before the grouped version normalised over the whole width."""
    return getattr(norm, "group_size", None) or norm.weight.shape[-1]


def gated_norm_reference(x, gate, weight, eps: float, group: int):
    """transformers' ``MambaRMSNormGated.forward`` (grouped), as maths: the reference of the check."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    grouped = h.view(*h.shape[:-1], h.shape[-1] // group, group)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(h.shape).to(dtype)


class GatedNorm(torch.autograd.Function):
    """fla's gated-RMSNorm kernels (``layer_norm_fwd``/``layer_norm_bwd``, norm after the gate) writing the
    output in ``out_dtype`` directly. The mixer casts the norm's fp32 output to the dtype out_proj takes; here
    the kernel stores it rounded once (the same values), and takes its gradient in that dtype: no fp32
    [tokens, d_inner] output, cast or cast-back in either direction."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float, group: int, out_dtype):
        from fla.modules.norm.layernorm_gated import layer_norm_fwd

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        z2 = gate.reshape(-1, shape[-1]).contiguous()
        weight = weight.contiguous()
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        y, _, rstd = layer_norm_fwd(
            x2, weight, None, eps, z=z2, out=out, group_size=group, norm_before_gate=False, is_rms_norm=True
        )
        ctx.save_for_backward(x2, z2, weight, rstd)
        ctx.eps, ctx.group, ctx.shape = eps, group, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        from fla.modules.norm.layernorm_gated import layer_norm_bwd

        x2, z2, weight, rstd = ctx.saved_tensors
        dx, dw, _, dz = layer_norm_bwd(
            dy.reshape(x2.shape).contiguous(), x2, weight, None, ctx.eps, None, rstd, z=z2,
            group_size=ctx.group, norm_before_gate=False, is_rms_norm=True,
        )  # fmt: skip
        return dx.view(ctx.shape), dz.view(ctx.shape), dw, None, None, None


def fused_gated_norm_forward(self, hidden_states, gate=None):
    """``MambaRMSNormGated.forward`` on fla's Triton kernels, its output already in the dtype out_proj takes
    (the gate's: in_proj's output). Without a gate (not how the mixer calls it): transformers' own forward."""
    if gate is None:
        return type(self).forward(self, hidden_states)
    return GatedNorm.apply(
        hidden_states, gate, self.weight, self.variance_epsilon, group_size(self), gate.dtype
    )


def check_gated_norm(device, dtype, groups: int = 2, kernel=None) -> float:
    """fla's gated RMSNorm against the eager maths in fp32: output and the gradients of x, gate and weight.
    fp32 input, as the scan hands it over; the gate in the run's dtype, as in_proj's output (and so the
    output, which the mixer would cast to that dtype for out_proj)."""
    width = 96 * groups
    (x,) = random_leaves((2, 24, width), device=device, dtype=torch.float32, scale=1.0)
    gate, weight = random_leaves((2, 24, width), (width,), device=device, dtype=dtype, scale=1.0)
    norm = types.SimpleNamespace(weight=weight, variance_epsilon=1e-5, group_size=width // groups)
    out = (kernel or fused_gated_norm_forward)(norm, x, gate)
    return compare(
        out, lambda x, g, w: gated_norm_reference(x, g, w, 1e-5, width // groups), [x, gate, weight]
    )


def gated_norm_checks(hf_config) -> dict:
    """The swap's start-up check, for Mamba-2 (Mamba-1's mixer has no gated norm)."""
    return {GATED_NORM: check_gated_norm} if hf_config.model_type == "mamba2" else {}


def use_fused_gated_norm(model) -> dict:
    """Swap every Mamba-2 mixer's gated norm of ``model`` onto fla's kernel; name -> modules swapped."""
    count = 0
    for module in model.modules():
        if type(module).__name__ == "MambaRMSNormGated":
            module.forward = types.MethodType(fused_gated_norm_forward, module)
            count += 1
    return {GATED_NORM: count} if count else {}
