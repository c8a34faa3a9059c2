"""Test-only entry point: ``python -m tests.fast_path_on_cpu <trainer args>`` runs the trainer with the CUDA
fast path's own autograd nodes (fused LoRA projections, Q/K/V groups, SwiGLU blocks) forced on a CPU.

Their maths runs on a CPU; Liger's Triton kernels do not, so here Liger's model patch is off, the self-check is
skipped (the fast path's tests check each kernel), and the fused loss runs ``CpuFusedLinearCrossEntropy``: Liger's
contract on a CPU (the gradients of the hidden states and the head computed in forward, handed back in backward),
so the head's weight gets its gradient from outside the head's own forward, as on the GPU. This is how tests
run the fast path under FSDP2 on gloo processes (tests/training/test_fsdp.py).

With ``KIT_TEST_CPU_GRAPHS=1`` the decoder layers also take the CUDA-graph paths (layer_graphs when
checkpointed, stack_graphs when not), with the CPU stand-in of tests/fastpath/test_layer_graphs.py for the
device's capture and replay."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from trainer import fastpath
from trainer.cli import main


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


fastpath.unavailable_reason = lambda device: None
fastpath.selfcheck.run = lambda *args, **kwargs: ()
fastpath._apply_liger = lambda *args, **kwargs: False
fastpath._liger_flce = lambda: cpu_fused_linear_cross_entropy
if os.environ.get("KIT_TEST_CPU_GRAPHS") == "1":
    from tests.fastpath.test_layer_graphs import ReplayOnCpu
    from trainer.fastpath import layer_graphs, stack_graphs

    decide_graphs = fastpath.graphs_unavailable
    # The real decision (processes, checkpointing, packing), as if on a GPU.
    fastpath.graphs_unavailable = lambda mode, device, *args, **kwargs: decide_graphs(
        mode, torch.device("cuda"), *args, **kwargs
    )
    layer_graphs.CudaGraphs = stack_graphs.CudaGraphs = ReplayOnCpu

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
