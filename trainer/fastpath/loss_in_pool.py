"""The fused loss in the free memory of the layer graphs' pool.

Why (bench/RESULTS.md, issue 31, session 28): with checkpointed layers replayed from CUDA graphs, the graphs'
pool keeps one layer's recompute-and-backward transients for the whole run (~0.9 GiB for Llama-1B at 4 x 2048),
unused between replays. Eagerly, the loss's transients (Liger's logits chunk, the picked rows, its working
gradient) reuse the memory a layer's backward freed; beside a pool they come on top of it and set the run's
peak. So the loss's forward allocates in the pool (``CudaGraphs.run_in_free_memory``) and only its two results,
the summed loss and the gradient of the picked hidden states, are copied out: nothing of the pool outlives the
call, and the next replay may write over all of it.

Only for a frozen head (LoRA, QLoRA): a trainable head's gradient would be a (vocabulary x hidden) copy.
"""

from __future__ import annotations

import torch

from trainer.data.dataset import IGNORE


def copied_out(compute) -> tuple:
    """``compute()``'s tensors copied: the contract of ``CudaGraphs.run_in_free_memory`` without a pool (the
    self-check runs before any graph exists)."""
    return tuple(t.clone() for t in compute())


def liger_halves():
    """Liger's fused linear cross-entropy as the two functions its own autograd node calls: the forward,
    which also computes the hidden states' gradient, and the backward, which scales it."""
    from liger_kernel.ops.fused_linear_cross_entropy import (
        fused_linear_cross_entropy_backward,
        fused_linear_cross_entropy_forward,
    )

    def forward_half(hidden, weight, labels, chunk_mem_const: int):
        loss, *_, grad_hidden, _, _ = fused_linear_cross_entropy_forward(
            hidden, weight, labels, ignore_index=IGNORE, reduction="sum", chunk_mem_const=chunk_mem_const,
            compute_gradients=True, weight_requires_grad=False,
        )  # fmt: skip
        return loss, grad_hidden

    def backward_half(grad_loss, grad_hidden):
        return fused_linear_cross_entropy_backward(grad_loss, grad_hidden, None, None)[0]

    return forward_half, backward_half


class FusedLossInPool(torch.autograd.Function):
    """Summed cross-entropy of ``flat[index]`` (cast to the head's dtype) through a frozen head's ``weight``,
    computed inside ``lend`` (``CudaGraphs.run_in_free_memory``): the row picking, the logits chunks and
    the working gradient all live in lent memory; the loss and the picked rows' gradient come back copied."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, flat, weight, index, labels, halves, lend, chunk_mem_const):
        forward_half, backward_half = halves

        def compute():
            return forward_half(flat.to(weight.dtype).index_select(0, index), weight, labels, chunk_mem_const)

        loss, grad_hidden = lend(compute)
        ctx.save_for_backward(grad_hidden, index)
        ctx.backward_half, ctx.shape, ctx.dtype = backward_half, flat.shape, flat.dtype
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss):
        grad_hidden, index = ctx.saved_tensors
        grad_hidden = ctx.backward_half(grad_loss, grad_hidden)
        grad_flat = grad_hidden.new_zeros(ctx.shape, dtype=ctx.dtype)
        grad_flat.index_copy_(0, index, grad_hidden.to(ctx.dtype))
        return grad_flat, None, None, None, None, None, None
