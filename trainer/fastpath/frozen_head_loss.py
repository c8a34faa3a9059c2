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
    """The summed loss and the hidden states' gradient: the kit's chunk loop over Liger's cross-entropy kernel
    (``chunked_forward``) where its logits come out as Liger's would (``same_logits_dtype``), else Liger's own
    forward (also where the kernel's arguments are not the ones known here)."""
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

    def liger(hidden, weight, labels, chunk_mem_const):
        loss, *_, grad_hidden, _, _ = fused_linear_cross_entropy_forward(
            hidden, weight, labels, ignore_index=IGNORE, reduction="sum", chunk_mem_const=chunk_mem_const,
            compute_gradients=True, weight_requires_grad=False,
        )  # fmt: skip
        return loss, grad_hidden

    if not set(LIGER_KERNEL_ARGUMENTS) <= set(getattr(liger_cross_entropy_kernel, "arg_names", ())):
        return liger
    chunked = chunked_forward(liger_rows_kernel(liger_cross_entropy_kernel))

    def forward(hidden, weight, labels, chunk_mem_const):
        pick = chunked if same_logits_dtype(hidden, weight) else liger
        return pick(hidden, weight, labels, chunk_mem_const)

    return forward


def same_logits_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch.mm(..., out=)`` in the inputs' dtype gives the logits autocast would: the chunk loop
    writes into one buffer with ``out=``, which autocast does not see (Liger makes the same choice)."""
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return not torch.is_autocast_enabled("cuda") or torch.get_autocast_dtype("cuda") == hidden.dtype


def chunked_forward(rows_kernel):
    """Liger's fused linear cross-entropy forward for a frozen head, without its host sync: the summed loss
    and the hidden states' gradient, one chunk of rows at a time (the same chunks, kernel and arithmetic).

    Liger's own forward first asks the GPU how many targets are not ignored (``.item()``), which stalls the host
    until the whole forward has run; the GPU then idles while the host launches the chunks (2.6 ms of a graphed
    Llama-1B step, bench/RESULTS.md session 31). The rows here are all targets (picked by the caller), and
    their count matters only to a mean: a sum needs none. ``rows_kernel(logits, labels, losses)`` writes each
    row's loss into ``losses`` and its logits' gradient over ``logits``, as Liger's kernel does."""

    def forward(hidden, weight, labels, chunk_mem_const):
        rows, width = hidden.shape
        per_row = -(-weight.shape[0] // (chunk_mem_const * width))  # Liger's chunking, to the same sizes
        chunk = min(1 << max(0, (-(-rows // per_row) - 1).bit_length()), rows)
        grad_hidden = torch.empty_like(hidden)
        losses = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        logits = torch.empty((chunk, weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            chunk_logits = logits[: end - start]
            torch.mm(hidden[start:end], weight.t(), out=chunk_logits)
            rows_kernel(chunk_logits, labels[start:end], losses[start:end])
            torch.mm(chunk_logits, weight, out=grad_hidden[start:end])
        return losses.sum(), grad_hidden

    return forward


# What ``liger_rows_kernel`` passes Liger's cross-entropy kernel (liger-kernel 0.8.5's names).
LIGER_KERNEL_ARGUMENTS = (
    "X_ptr", "X_stride", "Y_ptr", "Y_stride", "weight_ptr", "loss_ptr", "z_loss_ptr", "loss_stride",
    "token_accuracy_ptr", "token_accuracy_stride", "predicted_tokens_ptr", "predicted_tokens_stride", "n_cols",
    "n_non_ignore", "sum_non_ignore_weight", "weight_sum", "ignore_index", "lse_square_scale", "label_smoothing",
    "reduction", "softcap", "RETURN_Z_LOSS", "RETURN_TOKEN_ACCURACY", "RETURN_PREDICTED_TOKENS", "HAS_WEIGHT",
    "HAS_SOFTCAPPING", "HAS_GRADIENTS", "BLOCK_SIZE",
)  # fmt: skip


def liger_rows_kernel(kernel):
    """Liger's cross-entropy kernel over one chunk of rows, as its fused forward launches it for a sum."""

    def rows_kernel(logits, labels, losses):
        count = logits.shape[0]  # every row a target; unused by a sum
        block = min(32768, 1 << (logits.shape[1] - 1).bit_length())  # Liger's MAX_FUSED_SIZE on CUDA
        kernel[(logits.shape[0],)](
            X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=labels, Y_stride=labels.stride(-1), weight_ptr=None,
            loss_ptr=losses, z_loss_ptr=None, loss_stride=losses.stride(-1), token_accuracy_ptr=None,
            token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=logits.shape[1],
            n_non_ignore=count, sum_non_ignore_weight=count, weight_sum=0.0, ignore_index=IGNORE,
            lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=None, RETURN_Z_LOSS=False,
            RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, HAS_WEIGHT=False, HAS_SOFTCAPPING=False,
            HAS_GRADIENTS=True, BLOCK_SIZE=block, num_warps=32,
        )  # fmt: skip

    return rows_kernel


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
