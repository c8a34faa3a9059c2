"""The fused loss of a frozen head (LoRA, QLoRA): Liger's forward under the kit's own autograd node.

Liger's fused linear cross-entropy computes the hidden states' gradient in its forward; its backward only
scales that gradient by the incoming one. Two things about how its own node does that are costly here, and
this node does them otherwise:
- **Its backward asks the host whether the scale is 1.0** (``torch.equal``), which stalls the host until the
  GPU has caught up with the loss, and the GPU then idles while the host launches what follows (the profile
  of a graphed Llama-1B step, bench/RESULTS.md session 30). The step's scale (1 / the step's target tokens) is
  never 1.0 anyway: here the scaling is one multiplication on the device, the same arithmetic as Liger's
  kernel (the bf16 gradient times the fp32 scale, rounded once).
- **Its transient tensors sit beside the CUDA graphs' pool.** With checkpointed layers replayed from graphs,
  the pool keeps one layer's recompute-and-backward transients for the whole run (~0.9 GiB for Llama-1B at
  4 x 2048), free between replays; eagerly the loss reused that memory, beside a pool it comes on top and
  sets the run's peak (session 28). So the row picking, the logits chunks and the working gradient are
  computed inside ``lend`` (``CudaGraphs.run_in_free_memory``: in the pool's free memory), and only the
  two results, the summed loss and the picked rows' gradient, come back copied: nothing of the pool outlives
  the call, and the next replay may write over all of it.

A trainable head (full fine-tuning) keeps Liger's own node: its gradient would be a (vocabulary x hidden) copy.
"""

from __future__ import annotations

import torch

from trainer.data.dataset import IGNORE


def here(compute) -> tuple:
    """``compute()`` where it stands: no graphs' pool to lend (before the first capture, or no graphs)."""
    return compute()


def copied_out(compute) -> tuple:
    """``compute()``'s tensors copied: the contract of ``CudaGraphs.run_in_free_memory`` without a pool (the
    self-check runs before any graph exists)."""
    return tuple(t.clone() for t in compute())


def liger_forward():
    """Liger's forward (the function its own node calls): the summed loss and the hidden states' gradient."""
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    def forward(hidden, weight, labels, chunk_mem_const: int):
        loss, *_, grad_hidden, _, _ = fused_linear_cross_entropy_forward(
            hidden, weight, labels, ignore_index=IGNORE, reduction="sum", chunk_mem_const=chunk_mem_const,
            compute_gradients=True, weight_requires_grad=False,
        )  # fmt: skip
        return loss, grad_hidden

    return forward


class FrozenHeadLoss(torch.autograd.Function):
    """Summed cross-entropy of ``flat[index]`` (cast to the head's dtype) through a frozen head's ``weight``,
    computed inside ``lend`` (``here``, ``copied_out`` or ``CudaGraphs.run_in_free_memory``)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, flat, weight, index, labels, forward, lend, chunk_mem_const):
        def compute():
            return forward(flat.to(weight.dtype).index_select(0, index), weight, labels, chunk_mem_const)

        loss, grad_hidden = lend(compute)
        ctx.save_for_backward(grad_hidden, index)
        ctx.shape, ctx.dtype = flat.shape, flat.dtype
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss):
        grad_hidden, index = ctx.saved_tensors
        grad_hidden.mul_(grad_loss)  # on the device, whatever the scale: no host sync
        grad_flat = grad_hidden.new_zeros(ctx.shape, dtype=ctx.dtype)
        grad_flat.index_copy_(0, index, grad_hidden.to(ctx.dtype))
        return grad_flat, None, None, None, None, None, None
