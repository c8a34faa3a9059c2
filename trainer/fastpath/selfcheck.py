"""The causal fast path's kernel self-check: each of its kernels against eager PyTorch before the first step.

The LoRA projection on a 16-bit and on an NF4 base, the SwiGLU block and the fused linear cross-entropy (a
frozen head's, also as it runs beside CUDA-graphed layers, and a trainable one's): each one tiny forward and
backward in the run's compute dtype against eager PyTorch in fp32 (the comparison, tolerances and cache:
trainer/kernelcheck.py, shared with the GLA and Mamba families' checks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from trainer.fastpath import lora_ops
from trainer.kernelcheck import (
    TOLERANCE,
    TRITON_TOLERANCE,
    KernelCheck,
    compare,
    describe_failures,
    failures,
    random_leaves,
)
from trainer.kernelcheck import run as run_checks

__all__ = [
    "CHECKS",
    "TOLERANCE",
    "TRITON_TOLERANCE",
    "KernelCheck",
    "compare",
    "describe_failures",
    "failures",
    "random_leaves",
    "run",
]


def _eager_lora(x, w, a, b, scale):
    return x @ w.t() + scale * (x @ a.t()) @ b.t()


def check_lora_linear(device, dtype, kernel=lora_ops.lora_linear) -> float:
    w = (torch.randn(96, 64, device=device) * 0.1).to(dtype)
    x, a, b = random_leaves((2, 24, 64), (8, 64), (96, 8), device=device, dtype=dtype)
    out = kernel(x, a, b, lora_ops.BaseWeight(w, None), 2.0)
    return compare(out, lambda x, a, b: _eager_lora(x, w.float(), a, b, 2.0), [x, a, b])


def check_lora_mlp(device, dtype, kernel=lora_ops.lora_mlp) -> float:
    ws = [(torch.randn(*s, device=device) * 0.1).to(dtype) for s in ((128, 64), (128, 64), (64, 128))]
    x, *lo = random_leaves(
        (2, 24, 64), (8, 64), (128, 8), (8, 64), (128, 8), (8, 128), (64, 8), device=device, dtype=dtype
    )
    parts = [(lo[2 * i], lo[2 * i + 1], lora_ops.BaseWeight(ws[i], None), 1.5) for i in range(3)]
    out = kernel(x, *parts)

    def reference(x, ga, gb, ua, ub, da, db):
        h = F.silu(_eager_lora(x, ws[0].float(), ga, gb, 1.5)) * _eager_lora(x, ws[1].float(), ua, ub, 1.5)
        return _eager_lora(h, ws[2].float(), da, db, 1.5)

    return compare(out, reference, [x, *lo])


def check_lora_linear_nf4(device, dtype, kernel=lora_ops.lora_linear) -> float:
    """The 4-bit base: dequantized into the shared buffer, and again in backward."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit((torch.randn(128, 64, device=device) * 0.1).to(dtype), quant_type="nf4")
    weight = bnb.nn.Params4bit(
        q, requires_grad=False, quant_state=state, bnb_quantized=True, quant_type="nf4"
    )
    dense = bnbf.dequantize_4bit(q, state).float()
    x, a, b = random_leaves((2, 24, 64), (8, 64), (128, 8), device=device, dtype=dtype)
    out = kernel(x, a, b, lora_ops.BaseWeight(weight, None), 2.0)
    return compare(out, lambda x, a, b: _eager_lora(x, dense, a, b, 2.0), [x, a, b])


def check_fused_cross_entropy(device, dtype, kernel=None) -> float:
    """Liger's fused linear cross-entropy (the fast path's loss) against logits + F.cross_entropy in fp32."""
    from trainer import fastpath

    kernel = kernel or fastpath.fused_cross_entropy
    head = torch.nn.Linear(64, 500, bias=False, device=device).to(dtype)
    head.weight.requires_grad_(False)
    (hidden,) = random_leaves((2, 24, 64), device=device, dtype=dtype, scale=1.0)
    labels = torch.randint(0, 500, (2, 24), device=device)
    labels[0, :5] = -100
    out = kernel(head, hidden, labels)
    ref_head = torch.nn.Linear(64, 500, bias=False, device=device)
    ref_head.weight.data.copy_(head.weight.float())
    return compare(out, lambda h: fastpath.reference_cross_entropy(ref_head, h, labels), [hidden])


def check_fused_cross_entropy_lent(device, dtype, kernel=None) -> float:
    """The loss as it runs beside layers replayed from CUDA graphs (trainer/fastpath/frozen_head_loss.py, its
    results copied out of lent memory), the pool stood in for by copies."""
    from trainer import fastpath
    from trainer.fastpath import frozen_head_loss

    def lent(head, hidden, labels):
        return fastpath.fused_cross_entropy(head, hidden, labels, lend=frozen_head_loss.copied_out)

    return check_fused_cross_entropy(device, dtype, kernel or lent)


def check_fused_cross_entropy_trainable_head(device, dtype, kernel=None) -> float:
    """Full fine-tuning's loss: Liger's own node, which also hands back the head's gradient."""
    from trainer import fastpath

    kernel = kernel or fastpath.fused_cross_entropy
    hidden, weight = random_leaves((2, 24, 64), (500, 64), device=device, dtype=dtype, scale=1.0)
    head = torch.nn.Linear(64, 500, bias=False, device=device).to(dtype)
    head.weight = torch.nn.Parameter(weight)
    labels = torch.randint(0, 500, (2, 24), device=device)
    labels[1, 3:9] = -100
    out = kernel(head, hidden, labels)

    def reference(h, w):
        logits = (h[:, :-1] @ w.t()).float().reshape(-1, w.shape[0])
        return F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")

    return compare(out, reference, [hidden, head.weight])


def check_grouped_4bit_experts(device, dtype, kernel=None) -> float:
    """4-bit MoE experts packed into one tensor, dequantized in one launch and multiplied by a grouped GEMM
    (trainer/fastpath/moe_experts.py), against each expert dequantized by bitsandbytes and an eager loop."""
    from trainer.fastpath import moe_experts
    from trainer.moe_quant import QuantizedExpertWeights

    weights = QuantizedExpertWeights((torch.randn(4, 256, 64, device=device) * 0.1).to(dtype), "nf4", True)
    dense = torch.stack([weights[i] for i in range(len(weights))]).float()  # bitsandbytes, one expert each
    packed = moe_experts.pack_experts(weights)
    ends = [5, 5, 15, 24]  # expert 1 gets no tokens
    offsets = torch.tensor(ends, dtype=torch.int32, device=device)
    (x,) = random_leaves((24, 64), device=device, dtype=dtype)
    out = (kernel or moe_experts.GroupedFrozenLinear.apply)(x, packed, offsets)

    def reference(x):
        starts = [0, *ends[:-1]]
        return torch.cat([x[s:e] @ dense[i].t() for i, (s, e) in enumerate(zip(starts, ends, strict=True))])

    return compare(out, reference, [x])


CHECKS: dict[str, Callable] = {
    "lora_linear": check_lora_linear,
    "lora_linear_nf4": check_lora_linear_nf4,
    "lora_mlp": check_lora_mlp,
    "fused_cross_entropy": check_fused_cross_entropy,
    "fused_cross_entropy_lent": check_fused_cross_entropy_lent,
    "fused_cross_entropy_trainable_head": check_fused_cross_entropy_trainable_head,
    "grouped_4bit_experts": check_grouped_4bit_experts,
}


# Libraries whose kernels are checked: a new version of any of them is checked again.


def run(
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    checks: dict[str, Callable] | None = None,
    key: tuple | None = None,
    tolerance: dict | None = None,
):
    """The fast path's shipped checks (``checks`` None: measured once per process, device, dtype and library
    versions), or the ``checks`` given (tests: a deliberately wrong kernel)."""
    if checks is None:
        checks, key = CHECKS, ("causal fast path",)
    return run_checks(device, dtype, checks, key=key, tolerance=tolerance)
