"""Liger's fused linear cross-entropy on a CPU, for tests: its Triton kernels do not run here.

``cpu_fused_linear_cross_entropy`` stands in for Liger's functional entry point (``fastpath._liger_flce``), and
``cpu_flce_forward`` for its forward as ``trainer/fastpath/frozen_head_loss.py`` calls it
(``fastpath._flce_forward``). Importing this module changes nothing; ``tests.fast_path_on_cpu`` installs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class CpuFusedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` as Liger's fused kernel computes it: both gradients in
    forward (the logits never outlive it), scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index):
        wanted = [hidden.requires_grad, weight.requires_grad]
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(wanted[0])
            w = weight.detach().requires_grad_(wanted[1])
            loss = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=ignore_index, reduction="sum")
            leaves = [t for t, want in zip((h, w), wanted) if want]
            grads = iter(torch.autograd.grad(loss, leaves) if leaves else ())
        ctx.grads = [next(grads) if want else None for want in wanted]
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        return *(None if g is None else g * grad.to(g.dtype) for g in ctx.grads), None, None


def cpu_fused_linear_cross_entropy(hidden, weight, labels, ignore_index, reduction, chunk_mem_const):
    assert reduction == "sum" and chunk_mem_const >= 1
    return CpuFusedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index)


def cpu_flce_forward():
    """Liger's forward as ``frozen_head_loss`` calls it, on a CPU: the summed loss and the hidden states'
    gradient."""

    def forward(hidden, weight, labels, chunk_mem_const):
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(True)
            loss = F.cross_entropy((h @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
            (grad,) = torch.autograd.grad(loss, [h])
        return loss.detach(), grad

    return forward


def cpu_rows_kernel(logits, labels, losses):
    """Liger's cross-entropy kernel as ``frozen_head_loss.liger_rows_kernel`` launches it, on a CPU: each row's
    loss into ``losses`` and its logits' gradient (softmax minus the one-hot target) over ``logits``."""
    x = logits.float()
    losses.copy_(x.logsumexp(-1) - x.gather(1, labels[:, None]).squeeze(1))
    grad = x.softmax(-1)
    grad[torch.arange(len(labels)), labels] -= 1.0
    logits.copy_(grad.to(logits.dtype))
